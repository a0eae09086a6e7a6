"""Starting nereus clusters where users' clusters live: Slurm allocations and Kubernetes.

- ``SlurmCluster`` / ``SbatchOptions`` / ``render_sbatch``: the batch script that starts
  a controller on an allocation's first node, node daemons on every node (``srun``) and
  an RL job against them (``nereus slurm script``, ``nereus slurm run``).

This layer sits above the RL layer: it starts the controller, the node daemons and
``nereus run`` as processes, and imports none of their internals beyond their
command-line contracts (the ready lines they print).
"""

from __future__ import annotations

from nereus.launch.slurm import SbatchOptions, SlurmCluster, render_sbatch

__all__ = ["SbatchOptions", "SlurmCluster", "render_sbatch"]
