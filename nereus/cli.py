"""``nereus`` command line: one entry point, one subcommand per module.

Each subcommand lives with the layer it drives and is imported only when used,
so ``nereus --help`` is fast and never imports torch or cupy. A subcommand module
exposes ``main(argv: list[str]) -> int``.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main"]

# subcommand -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("nereus.job.cli", "run an RL job from a TOML config (e.g. examples/grpo_tiny.toml)"),
    "export": ("nereus.job.export", "write a job's trained policy as a Hugging Face folder"),
    "plan": (
        "nereus.planner.cli",
        "search a plan for a cluster, model and algorithm and explain it",
    ),
    "simulate": (
        "nereus.sim.cli",
        "compare layout policies on a simulated cluster replaying device and length traces",
    ),
    "tap": (
        "nereus.monitor.tap",
        "print (or write as JSONL) the live monitoring tap of a controller",
    ),
    "dashboard": (
        "nereus.monitor.dashboard",
        "serve a local web page that follows a run's tap (or a recorded one) live",
    ),
    "controller": (
        "nereus.actors._controller",
        "run a standalone controller that node daemons join",
    ),
    "node": ("nereus.node", "run the per-host node daemon (one worker process per device)"),
    "curve-key": (
        "nereus.actors._curve",
        "write a CURVE secret key file that encrypts tcp sockets",
    ),
    "slurm": ("nereus.launch.slurm_cli", "start a cluster (and an RL job) in a Slurm allocation"),
    "k8s": (
        "nereus.launch.k8s_cli",
        "render the Kubernetes manifests of a cluster (and an RL job)",
    ),
}


def _usage() -> str:
    width = max(len(c) for c in _COMMANDS)
    lines = ["usage: nereus COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "`nereus COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in _COMMANDS:
        print(f"nereus: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
