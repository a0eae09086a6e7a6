"""ModelConfig: Hugging Face config.json in and out, and validation errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.errors import ConfigError
from nereus.models import ModelConfig, tiny_config


def test_from_transformers_config_files(tmp_path):
    from transformers import LlamaConfig, Qwen2Config

    LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=5e5,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path / "llama")
    c = ModelConfig.from_hf(tmp_path / "llama")
    assert (c.architecture, c.vocab_size, c.hidden_size, c.head_dim) == ("llama", 100, 32, 8)
    assert (c.num_key_value_heads, c.rope_theta, c.tie_word_embeddings, c.attention_bias) == (
        1,
        5e5,
        True,
        False,
    )

    Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path / "qwen")
    q = ModelConfig.from_hf(tmp_path / "qwen" / "config.json")
    assert q.architecture == "qwen2" and q.attention_bias and q.has_qkv_bias and not q.has_o_bias


def test_reads_old_style_rope_theta_and_torch_dtype():
    data = tiny_config().to_hf()
    del data["rope_parameters"]
    data["rope_theta"] = 123.0
    data["torch_dtype"] = "bfloat16"
    c = ModelConfig.from_hf(data)
    assert c.rope_theta == 123.0 and c.torch_dtype == "bfloat16"


def test_to_hf_is_read_back_by_transformers(tmp_path):
    from transformers import AutoConfig

    c = tiny_config("qwen2", tie_word_embeddings=True)
    c.save(tmp_path)
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "Qwen2Config"
    assert hf.num_key_value_heads == c.num_key_value_heads and hf.tie_word_embeddings


@settings(max_examples=30, deadline=None)
@given(
    arch=st.sampled_from(["llama", "qwen2", "qwen3"]),
    heads=st.sampled_from([1, 2, 4, 8]),
    kv_div=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([2, 8, 16]),
    tied=st.booleans(),
    bias=st.booleans(),
    layers=st.integers(1, 6),
)
def test_hf_round_trip(arch, heads, kv_div, head_dim, tied, bias, layers):
    kv = max(1, heads // kv_div)
    c = ModelConfig(
        vocab_size=50,
        hidden_size=heads * head_dim,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=tied,
        attention_bias=bias or arch == "qwen2",
        architecture=arch,
    )
    assert ModelConfig.from_hf(json.loads(json.dumps(c.to_hf()))) == c


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_and_qwen3_configs_from_transformers(tmp_path):
    from transformers import AutoConfig, LlamaConfig, Qwen3Config

    # A Llama-3.1 config.json as the Hub ships it: rope_scaling at the top level.
    data = {**tiny_config().to_hf(), "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE)}
    del data["rope_parameters"]
    c = ModelConfig.from_hf(data)
    assert (c.rope_type, c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor) == (
        "llama3",
        8.0,
        1.0,
        4.0,
    )
    assert (c.rope_original_max_position_embeddings, c.rope_theta) == (8192, 500000.0)
    # transformers 5 writes rope_parameters; both spellings read to the same config.
    LlamaConfig(
        **{
            k: data[k]
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        },
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE),
    ).save_pretrained(tmp_path / "llama3")
    assert ModelConfig.from_hf(tmp_path / "llama3").rope_scaling == c.rope_scaling
    c.save(tmp_path / "ours")
    hf = AutoConfig.from_pretrained(tmp_path / "ours")
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["factor"] == 8.0
    assert ModelConfig.from_hf(tmp_path / "ours") == c

    Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path / "qwen3")
    q = ModelConfig.from_hf(tmp_path / "qwen3")
    assert (q.architecture, q.head_dim, q.has_qk_norm, q.attention_bias, q.tie_word_embeddings) == (
        "qwen3",
        16,
        True,
        False,
        True,
    )
    assert ModelConfig.from_hf(q.to_hf()) == q
    biased = q.replace(attention_bias=True)
    assert (
        biased.has_qkv_bias and biased.has_o_bias
    )  # Qwen3's attention_bias covers o_proj, like Llama's
    assert (
        type(
            AutoConfig.for_model(**{k: v for k, v in q.to_hf().items() if k != "architectures"})
        ).__name__
        == "Qwen3Config"
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"rope_type": "yarn"}, "rope_type='yarn'"),
        ({"rope_type": "linear", "rope_factor": 0.5}, "rope_factor=0.5"),
        ({"rope_type": "llama3", "rope_factor": 8.0}, "rope_original_max_position_embeddings=0"),
        (
            {
                "rope_type": "llama3",
                "rope_factor": 8.0,
                "rope_original_max_position_embeddings": 64,
                "rope_low_freq_factor": 4.0,
                "rope_high_freq_factor": 1.0,
            },
            "rope_high_freq_factor=1.0",
        ),
    ],
)
def test_bad_rope_scaling_names_the_field(change, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        tiny_config(**change)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}},
            "rope_type 'llama3' needs ['low_freq_factor'",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling rope_type='yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE scaling rope_type='dynamic'"),
        ({"model_type": "qwen3", "layer_types": ["sliding_attention"] * 4}, "layer_types="),
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"hidden_size": 0}, "hidden_size=0"),
        ({"head_dim": 7}, "head_dim=7"),
        ({"torch_dtype": "int8"}, "torch_dtype='int8'"),
    ],
)
def test_bad_configs_name_the_field(change, words):
    data = {**tiny_config().to_hf(), **change}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_hf(data)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="missing required key"):
        ModelConfig.from_hf(tmp_path)


def test_replace_validates():
    c = tiny_config()
    assert c.replace(num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ConfigError, match="no field"):
        c.replace(nope=1)
    with pytest.raises(ConfigError, match="qwen2"):
        c.replace(architecture="qwen2", attention_bias=False)
