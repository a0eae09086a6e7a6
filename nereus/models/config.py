"""``ModelConfig``: the shape of one Llama/Qwen2/Qwen3-style decoder, read from and written
to Hugging Face ``config.json``.

Promises:
- ``ModelConfig.from_hf(path_or_dict)`` accepts a directory holding ``config.json``, the
  file itself, or the parsed dict, for ``model_type`` ``"llama"`` (Llama 2 and 3),
  ``"qwen2"`` and ``"qwen3"``, old and transformers-5 spellings alike;
- RoPE scaling ``"default"``, ``"linear"`` and ``"llama3"``, computed as transformers
  computes them; Qwen3's per-head q/k norms; each family's biases;
- ``to_hf()`` returns a dict that transformers loads as the same architecture and that
  ``from_hf`` reads back to an equal ``ModelConfig``;
- every field is validated in ``__post_init__``: an error names the field, the value and
  the rule.

Refuses (``ConfigError``): other architectures, an activation other than SiLU, RoPE
scaling other than the three above (``yarn``, ``dynamic``, ``longrope``), MLP biases,
sliding-window attention -- features this model family does not implement and would
otherwise silently get wrong.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from nereus.config import require
from nereus.errors import ConfigError

__all__ = ["ModelConfig", "ARCHITECTURES"]

Architecture = Literal["llama", "qwen2", "qwen3"]

# model_type -> the class name transformers writes into "architectures".
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DTYPES = ("float32", "float16", "bfloat16")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Every number the decoder is built from (Hugging Face field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    torch_dtype: str = "float32"
    architecture: Architecture = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rope_type: str = "default"  # "default", "linear" or "llama3"
    rope_factor: float = 1.0  # linear, llama3: how much longer the context is than trained
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / low are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept
    rope_original_max_position_embeddings: int = 0  # llama3: the pretraining context

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"ModelConfig.{name}",
                value,
                "must be an integer >= 1",
            )
        if self.head_dim == 0:
            require(
                self.hidden_size % self.num_attention_heads == 0,
                "ModelConfig.hidden_size",
                self.hidden_size,
                f"must be divisible by num_attention_heads={self.num_attention_heads} when "
                "head_dim is not given",
            )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        require(
            self.head_dim >= 2 and self.head_dim % 2 == 0,
            "ModelConfig.head_dim",
            self.head_dim,
            "must be an even integer >= 2 (RoPE rotates pairs)",
        )
        require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "ModelConfig.num_key_value_heads",
            self.num_key_value_heads,
            f"must divide num_attention_heads={self.num_attention_heads}",
        )
        require(self.rms_norm_eps > 0, "ModelConfig.rms_norm_eps", self.rms_norm_eps, "must be > 0")
        require(self.rope_theta > 0, "ModelConfig.rope_theta", self.rope_theta, "must be > 0")
        require(
            self.torch_dtype in _DTYPES,
            "ModelConfig.torch_dtype",
            self.torch_dtype,
            f"must be one of {list(_DTYPES)}",
        )
        require(
            self.architecture in ARCHITECTURES,
            "ModelConfig.architecture",
            self.architecture,
            f"must be one of {sorted(ARCHITECTURES)}",
        )
        if self.architecture == "qwen2":
            require(
                self.attention_bias,
                "ModelConfig.attention_bias",
                self.attention_bias,
                "must be true for qwen2 (its q/k/v projections always have biases)",
            )
        require(
            self.rope_type in ROPE_TYPES,
            "ModelConfig.rope_type",
            self.rope_type,
            f"must be one of {list(ROPE_TYPES)}",
        )
        if self.rope_type != "default":
            require(
                self.rope_factor >= 1.0,
                "ModelConfig.rope_factor",
                self.rope_factor,
                f"must be >= 1 for rope_type={self.rope_type!r}",
            )
        if self.rope_type == "llama3":
            require(
                self.rope_high_freq_factor > self.rope_low_freq_factor > 0,
                "ModelConfig.rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"must be > rope_low_freq_factor={self.rope_low_freq_factor} > 0",
            )
            require(
                self.rope_original_max_position_embeddings >= 1,
                "ModelConfig.rope_original_max_position_embeddings",
                self.rope_original_max_position_embeddings,
                "must be >= 1 for rope_type='llama3'",
            )

    # --- derived numbers -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def has_o_bias(self) -> bool:
        # Qwen2 puts biases on q/k/v only; Llama's and Qwen3's attention_bias covers o_proj too.
        return self.attention_bias and self.architecture != "qwen2"

    @property
    def has_qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over each query and key head before RoPE."""
        return self.architecture == "qwen3"

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The scaling entries of Hugging Face's ``rope_parameters`` (None for default RoPE)."""
        if self.rope_type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.rope_factor}
        if self.rope_type == "llama3":
            out.update(
                low_freq_factor=self.rope_low_freq_factor,
                high_freq_factor=self.rope_high_freq_factor,
                original_max_position_embeddings=self.rope_original_max_position_embeddings,
            )
        return out

    # --- Hugging Face ----------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config (directory, config.json path, or dict)."""
        if isinstance(source, dict):
            data, where = source, "config dict"
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            where = str(path)
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise ConfigError(f"model config {where!r} does not exist") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"model config {where!r} is not valid JSON: {e}") from None
        return cls._from_hf_dict(data, where)

    @classmethod
    def _from_hf_dict(cls, data: dict[str, Any], where: str) -> ModelConfig:
        arch = data.get("model_type")
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"{where}: model_type={arch!r} must be one of {sorted(ARCHITECTURES)}"
            )
        act = data.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act={act!r} must be 'silu' (SwiGLU)")
        if data.get("mlp_bias", False):
            raise ConfigError(
                f"{where}: mlp_bias=True is not supported (the family has no MLP biases)"
            )
        if data.get("use_sliding_window", False):
            raise ConfigError(
                f"{where}: use_sliding_window=True is not supported (full attention only)"
            )
        if data.get("layer_types") and any(t != "full_attention" for t in data["layer_types"]):
            raise ConfigError(
                f"{where}: layer_types={data['layer_types']!r} must all be 'full_attention'"
            )
        # transformers 5 writes rope_parameters; older files rope_theta and rope_scaling.
        old_style = dict(data.get("rope_scaling") or {})
        if "type" in old_style and "rope_type" not in old_style:
            old_style["rope_type"] = old_style.pop("type")
        rope = {**(data.get("rope_parameters") or {}), **old_style}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"{where}: RoPE scaling rope_type={rope_type!r} is not supported; expected "
                f"one of {list(ROPE_TYPES)}"
            )
        scaling: dict[str, Any] = {}
        if rope_type != "default":
            scaling = {"rope_type": rope_type, "rope_factor": float(rope.get("factor", 1.0))}
        if rope_type == "llama3":
            missing = [
                k
                for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                if k not in rope
            ]
            if missing:
                raise ConfigError(
                    f"{where}: rope_type 'llama3' needs {missing} in rope_scaling/rope_parameters"
                )
            scaling.update(
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        theta = rope.get("rope_theta", data.get("rope_theta", 10000.0))
        dtype = data.get("torch_dtype") or data.get("dtype") or "float32"
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(f"{where}: missing required key(s) {missing}")
        eos = data.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data.get("num_key_value_heads") or data["num_attention_heads"],
            head_dim=data.get("head_dim") or 0,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(data.get("attention_bias", False)),
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            torch_dtype=str(dtype),
            architecture=arch,
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=eos,
            **scaling,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict transformers reads as this architecture."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {
                "rope_type": "default",
                **(self.rope_scaling or {}),
                "rope_theta": self.rope_theta,
            },
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        if self.architecture == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        else:
            out["use_sliding_window"] = False
            out["sliding_window"] = None
        if self.architecture == "qwen3":
            out["attention_bias"] = self.attention_bias
        return out

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` into ``directory``; returns its path."""
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_hf(), indent=2, sort_keys=True) + "\n")
        return path

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (and validated)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"ModelConfig has no field(s) {unknown}")
        return ModelConfig(**{**asdict(self), **changes})
