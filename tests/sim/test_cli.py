"""``nereus simulate`` from the command line: the table, the JSON list with the issue's
keys, the PNG, the ground truth's reasons, and errors that name the flag."""

from __future__ import annotations

import json
import sys

import pytest

from nereus.cli import main as nereus_main


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "spot.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [16, 16, 8, 16] * 10}))
    return str(path)


def _args(spot: str, *extra: str) -> list[str]:
    return [
        "simulate",
        "--cluster",
        "h100-8",
        "--model",
        "llama-1b",
        "--algo",
        "grpo",
        "--gpus-trace",
        spot,
        "--pool-scale",
        "0.5",
        "--length-trace",
        "growth:300:2000",
        "--steps",
        "5",
        "--prompts",
        "16",
        "--policies",
        "adaptive,static,colocated",
        *extra,
    ]


def test_simulate_prints_the_table_and_writes_json_and_png(spot, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert nereus_main(_args(spot, "--json", str(out_json), "--plot", str(out_png))) == 0
    printed = capsys.readouterr().out
    assert "SIMULATION" in printed and "adaptive" in printed and "reduction_vs_static" in printed
    data = json.loads(out_json.read_text())
    assert [d["policy"] for d in data] == ["adaptive", "static", "colocated"]
    for d in data:
        assert {
            "policy",
            "mean_step_s",
            "transitions",
            "transition_overhead_pct",
            "memory_failures",
        } <= set(d)
        assert d["simulated"] is True and d["steps"] == 5
    assert {"reduction_vs_static", "reduction_vs_best_baseline"} <= set(data[0])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_oracle_is_printed_and_written_as_a_reference(spot, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    args = _args(spot, "--json", str(out_json))
    args[args.index("adaptive,static,colocated")] = "adaptive,static,oracle"
    assert nereus_main(args) == 0
    assert "oracle (a reference, not a policy" in capsys.readouterr().out
    data = {d["policy"]: d for d in json.loads(out_json.read_text())}
    assert data["oracle"]["reference"] is True and "reduction_vs_static" in data["oracle"]
    assert data["adaptive"]["best_baseline"] == "static"


def test_plot_without_matplotlib_is_a_clear_error_after_the_json(
    spot, tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    out_json = tmp_path / "r.json"
    code = nereus_main(_args(spot, "--json", str(out_json), "--plot", str(tmp_path / "r.png")))
    assert code == 2 and "needs matplotlib" in capsys.readouterr().err
    assert json.loads(out_json.read_text())[0]["policy"] == "adaptive"


def test_bad_arguments_name_the_flag(spot, capsys):
    assert nereus_main(["simulate", "--length-trace", "growth:1:2"]) == 2
    assert "--gpus-trace" in capsys.readouterr().err
    assert nereus_main(_args(spot)[:-2] + ["--policies", "adaptive,bogus"]) == 2
    assert "policies" in capsys.readouterr().err
    assert nereus_main(_args(spot, "--cap-schedule", "doubling")) == 2
    assert "cap_schedule='doubling'" in capsys.readouterr().err
    assert (
        nereus_main(["simulate", "--gpus-trace", "growth:8:8", "--length-trace", "nothing.json"])
        == 2
    )
    assert "--length-trace='nothing.json'" in capsys.readouterr().err


def test_show_truth_prints_every_parameter_with_its_reason(capsys):
    assert nereus_main(["simulate", "--show-truth"]) == 0
    printed = capsys.readouterr().out
    assert "training.mfu_by_tp" in printed and "restart.points" in printed and "Megatron" in printed
