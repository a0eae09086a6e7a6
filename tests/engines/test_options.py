"""EngineOptions: the options every engine is built with, validated once."""

import pytest
import torch

from nereus.engines import EngineOptions, GenerationEngine, InferenceEngine
from nereus.engines.memory import MemoryLedger
from nereus.errors import ConfigError
from nereus.models import tiny_config


def test_refuses_what_no_engine_can_build_from():
    with pytest.raises(ConfigError, match="tensors and model_dir"):
        EngineOptions(model_dir="m", tensors={})
    with pytest.raises(ConfigError, match="dtype"):
        EngineOptions(dtype="float13")
    with pytest.raises(ConfigError, match="seed"):
        EngineOptions(seed=1.5)
    with pytest.raises(ConfigError, match="name"):
        EngineOptions(name="")


def test_name_falls_back_to_the_engine_default():
    assert EngineOptions().named("generation") == "generation"
    assert EngineOptions(name="policy").named("generation") == "policy"
    assert EngineOptions(seed=3).with_(name="x") == EngineOptions(seed=3, name="x")


def test_engines_take_their_shared_options_from_it():
    config = tiny_config(num_hidden_layers=1)
    ledger = MemoryLedger("opts", None)
    gen = GenerationEngine(config, options=EngineOptions(seed=4, ledger=ledger, name="g"))
    inf = InferenceEngine(config, options=EngineOptions(seed=4, ledger=ledger))
    assert (gen.name, inf.name) == ("g", "inference")
    assert gen.ledger is ledger and inf.ledger is ledger
    assert gen.dtype == inf.dtype == torch.float32
    # the same seed initialises the same weights, whichever engine holds them
    for key, tensor in gen.named_weights().items():
        assert torch.equal(tensor, inf.named_weights()[key])
    gen.close()
    inf.close()
    assert ledger.used_bytes == 0
