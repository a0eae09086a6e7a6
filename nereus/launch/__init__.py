"""Starting nereus clusters where users' clusters live: Slurm allocations and Kubernetes.

- ``SlurmCluster`` / ``SbatchOptions`` / ``render_sbatch``: the batch script that starts
  a controller on an allocation's first node, node daemons on every node (``srun``) and
  an RL job against them (``nereus slurm script``, ``nereus slurm run``).
- ``KubernetesCluster`` / ``render_manifests``: a controller Deployment, a StatefulSet
  of node daemons, the key as a Secret and an RL Job (``nereus k8s render``).

This layer sits above the RL layer: it starts the controller, the node daemons and
``nereus run`` as processes (or describes the pods that run them) and relies on nothing
of theirs but their command lines and the ready lines they print.
"""

from __future__ import annotations

from nereus.launch.kubernetes import KubernetesCluster, render_manifests
from nereus.launch.slurm import SbatchOptions, SlurmCluster, render_sbatch

__all__ = [
    "KubernetesCluster",
    "SbatchOptions",
    "SlurmCluster",
    "render_manifests",
    "render_sbatch",
]
