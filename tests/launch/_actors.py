"""Actor classes the launch tests spawn on clusters that Slurm started."""

from __future__ import annotations

import os

from nereus.actors import Actor, current_device, endpoint


class Where(Actor):
    """Reports what the worker process it lives in sees."""

    @endpoint
    async def where(self) -> dict:
        d = current_device()
        return {
            "index": d.index,
            "kind": d.kind,
            "node_id": d.node_id,
            "local_index": d.local_index,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
