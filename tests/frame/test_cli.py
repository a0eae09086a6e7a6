"""The `nereus` entry point dispatches to subcommand modules without importing them eagerly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nereus.cli import main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("run", "plan", "tap", "controller", "node"):
        assert name in out


def test_unknown_command_is_an_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.integration
def test_help_does_not_import_torch():
    code = (
        "import sys; from nereus.cli import main; main(['--help']); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "False"
