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

    LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=1, rope_theta=5e5,
                tie_word_embeddings=True).save_pretrained(tmp_path / "llama")
    c = ModelConfig.from_hf(tmp_path / "llama")
    assert (c.architecture, c.vocab_size, c.hidden_size, c.head_dim) == ("llama", 100, 32, 8)
    assert (c.num_key_value_heads, c.rope_theta, c.tie_word_embeddings, c.attention_bias) == (1, 5e5, True, False)

    Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2).save_pretrained(tmp_path / "qwen")
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
    arch=st.sampled_from(["llama", "qwen2"]),
    heads=st.sampled_from([1, 2, 4, 8]),
    kv_div=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([2, 8, 16]),
    tied=st.booleans(),
    bias=st.booleans(),
    layers=st.integers(1, 6),
)
def test_hf_round_trip(arch, heads, kv_div, head_dim, tied, bias, layers):
    kv = max(1, heads // kv_div)
    c = ModelConfig(vocab_size=50, hidden_size=heads * head_dim, intermediate_size=24, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
                    attention_bias=bias or arch == "qwen2", architecture=arch)
    assert ModelConfig.from_hf(json.loads(json.dumps(c.to_hf()))) == c


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "RoPE scaling"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling"),
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
