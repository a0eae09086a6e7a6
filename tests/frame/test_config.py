"""nereus.config: dataclasses from plain data and TOML, with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from nereus.config import from_dict, load_toml, parse_size, require, to_dict
from nereus.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")


@dataclass(frozen=True)
class Job:
    name: str
    steps: int = 10
    algo: Literal["ppo", "grpo", "remax"] = "grpo"
    devices: list[int] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    note: str | None = None


def test_builds_nested_dataclasses_and_round_trips():
    job = from_dict(
        Job, {"name": "a", "steps": 3, "devices": [0, 1], "sampling": {"temperature": 1}}
    )
    assert job == Job(name="a", steps=3, devices=[0, 1], sampling=Sampling(temperature=1.0))
    assert isinstance(job.sampling.temperature, float)
    assert from_dict(Job, to_dict(job)) == job


@pytest.mark.parametrize(
    "data, words",
    [
        ({"name": "a", "stepz": 1}, ["unknown key", "stepz", "steps"]),
        ({}, ["name is required"]),
        ({"name": "a", "steps": "3"}, ["steps='3'", "integer"]),
        ({"name": "a", "steps": True}, ["steps=True", "integer"]),
        ({"name": "a", "algo": "dpo"}, ["algo='dpo'", "grpo"]),
        ({"name": "a", "devices": [0, "x"]}, ["devices[1]='x'", "integer"]),
        ({"name": "a", "sampling": {"temperature": -1}}, ["sampling.temperature=-1", ">= 0"]),
        ({"name": "a", "sampling": {"top_p": 0.5}}, ["sampling", "unknown key", "top_p"]),
        ({"name": "a", "note": 3}, ["note=3"]),
    ],
)
def test_errors_name_field_value_and_rule(data, words):
    with pytest.raises(ConfigError) as info:
        from_dict(Job, data)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_load_toml(tmp_path):
    p = tmp_path / "job.toml"
    p.write_text('name = "x"\nsteps = 4\n[sampling]\ntemperature = 0.5\n')
    assert load_toml(Job, p) == Job(name="x", steps=4, sampling=Sampling(0.5))
    p.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(Job, p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(Job, tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "text, value",
    [
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("4GB", 4 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        ("100", 100),
        (7, 7),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "2XB", "-3", True])
def test_parse_size_refuses(text):
    with pytest.raises(ConfigError, match="memory"):
        parse_size(text, field="memory")


@dataclass(frozen=True)
class Betas:
    betas: tuple[float, float] = (0.9, 0.999)


def test_fixed_length_tuples():
    assert from_dict(Betas, {"betas": [0.8, 1]}) == Betas((0.8, 1.0))
    with pytest.raises(ConfigError, match="must have 2 items"):
        from_dict(Betas, {"betas": [0.8]})
    with pytest.raises(ConfigError, match=r"betas\[1\]='x'"):
        from_dict(Betas, {"betas": [0.8, "x"]})
