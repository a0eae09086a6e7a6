"""nereus.transfer: the tensor data plane (see DESIGN.md section 2 and 7).

Public API:
- ``Communicator``, ``P2POp``, ``ReduceOp``: the contract every backend implements.
- ``CpuCommunicator``: gloo collectives + shared-memory p2p for CPU tensors, built
  directly from a store address (no actor runtime needed).
"""

from nereus.transfer.communicator import Communicator, P2POp, ReduceOp
from nereus.transfer.cpu import CpuCommunicator

__all__ = ["Communicator", "CpuCommunicator", "P2POp", "ReduceOp"]
