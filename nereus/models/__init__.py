"""nereus.models: the Llama/Qwen2/Qwen3-style decoder with TP/PP-aware layers, and Hugging
Face config, safetensors, tokenizer and chat-template loading, and export back to a
Hugging Face folder (see docs/design.md and each module's docstring)."""

from nereus.models.chat import load_chat_template, render_chat
from nereus.models.checkpoint import (
    LoadReport,
    hf_state_dict,
    hf_tensor_names,
    load_stage_weights,
    save_checkpoint,
)
from nereus.models.config import ModelConfig
from nereus.models.decoder import DecoderStage, KVCache, build_stage, check_layout, torch_dtype
from nereus.models.export import export_hf
from nereus.models.layers import (
    ColumnParallelLinear,
    HeadRMSNorm,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    ShardedModule,
    ValueHead,
    VocabParallelEmbedding,
    component_range,
)
from nereus.models.parallel import (
    ParallelContext,
    copy_to_tp,
    gather_from_tp,
    gather_vocab,
    reduce_from_tp,
    stage_layer_range,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from nereus.models.spec import model_spec, shard_tensor
from nereus.models.tiny import save_tiny_model, tiny_config
from nereus.models.tokenizer import TextTokenizer, load_tokenizer, train_tiny_tokenizer

__all__ = [
    "ModelConfig",
    "ParallelContext",
    "DecoderStage",
    "KVCache",
    "build_stage",
    "check_layout",
    "torch_dtype",
    "model_spec",
    "shard_tensor",
    "LoadReport",
    "load_stage_weights",
    "save_checkpoint",
    "hf_state_dict",
    "hf_tensor_names",
    "save_tiny_model",
    "tiny_config",
    "TextTokenizer",
    "load_tokenizer",
    "train_tiny_tokenizer",
    "ShardedModule",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "RMSNorm",
    "HeadRMSNorm",
    "ValueHead",
    "component_range",
    "export_hf",
    "load_chat_template",
    "render_chat",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "gather_vocab",
    "vocab_parallel_logprobs",
    "vocab_parallel_entropy",
    "stage_layer_range",
]
