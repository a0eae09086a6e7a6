"""Character vocabulary and the codec the step loop uses."""

from __future__ import annotations

import pytest

from nereus.data.tasks import ArithmeticTask
from nereus.data.vocab import Codec
from nereus.errors import ConfigError


def test_char_codec_roundtrip_and_eos(tmp_path):
    task = ArithmeticTask()
    codec = Codec.for_alphabet(task.alphabet)
    s = task.sample(0, seed=0)
    ids = codec.encode(s.prompt)
    assert ids[0] == codec.bos_id and len(ids) == len(s.prompt) + 1
    assert codec.decode(ids[1:]) == s.prompt
    assert (
        codec.decode(
            codec.encode("12", add_bos=False) + [codec.eos_id] + codec.encode("9", add_bos=False)
        )
        == "12"
    )
    codec.save(tmp_path)
    again = Codec.from_dir(tmp_path)
    assert again.encode(s.prompt) == ids and again.eos_id == codec.eos_id


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="alphabet='aa.*must not repeat a character"):
        Codec.for_alphabet("aa")
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        Codec.from_dir(tmp_path)
