"""nereus.transfer: the tensor data plane (see docs/design.md §2, §7).

Public API:
- ``Communicator``, ``P2POp``, ``ReduceOp``: the contract every backend implements.
- ``CpuCommunicator``: gloo collectives + shared-memory p2p for CPU tensors, built
  directly from a store address (no actor runtime needed).
- ``NcclCommunicator`` (``nereus.transfer.nccl``, imported on use: needs libnccl): NCCL
  on a CUDA stream of its own, ordered against the caller's by events (docs/gpu.md).
- ``exchange``, ``TransferStats``: bucketed, double-buffered transfers of tensor views
  (``nereus.transfer.bucket.pack_buckets``: the buckets it sends, packed).
- ``exchange_direct``, ``arena_empty``: senders copy straight into receivers' arenas
  (pooled shared memory of the receiving process), one copy per moved byte;
  ``arena_pool_stats``: this process's pool of them (free and busy).
- ``copy_into``: ``dst.copy_(src)`` with large contiguous pieces copied by the C
  library's memmove (non-temporal stores in node workers).
- ``make_group``, ``release_groups``, ``GroupHandle`` (controller side) and
  ``get_communicator``, ``release_epoch``, ``local_groups`` (worker side).

Importing nereus.transfer never imports cupy or loads libnccl.
"""

from nereus.transfer._arena import pool_stats as arena_pool_stats
from nereus.transfer._copy import copy_into
from nereus.transfer._shm import SHM_DIR
from nereus.transfer.bucket import TransferStats, exchange
from nereus.transfer.communicator import Communicator, P2POp, ReduceOp
from nereus.transfer.cpu import CpuCommunicator
from nereus.transfer.direct import arena_empty, exchange_direct
from nereus.transfer.group import (
    GroupHandle,
    get_communicator,
    local_groups,
    make_group,
    release_epoch,
    release_groups,
)

__all__ = [
    "SHM_DIR",
    "Communicator",
    "CpuCommunicator",
    "GroupHandle",
    "P2POp",
    "ReduceOp",
    "TransferStats",
    "arena_empty",
    "arena_pool_stats",
    "copy_into",
    "exchange",
    "exchange_direct",
    "get_communicator",
    "local_groups",
    "make_group",
    "release_epoch",
    "release_groups",
]
