"""Which dtype a job's model-stages compute in when its config says ``auto``.

``model.dtype = "auto"`` (the default) resolves, once the job knows its devices, to
``bfloat16`` where every device is a GPU and to ``float32`` otherwise (CPU workers, or a
mix). bfloat16 is what GPU kernels are built for (vLLM has no FlashAttention backend
for float32 and compiles a slow fallback on first use); on a CPU, float32 is faster and
exact. Training in bfloat16 keeps float32 master weights and float32 AdamW moments
(``nereus.state.training_slots``): only the copies the forward pass reads are rounded.
An explicit ``float32`` or ``bfloat16`` is kept as it is.

Pure: names in, a name out. Refuses (``ConfigError``): an unknown dtype name, ``auto``
with no device to look at.
"""

from __future__ import annotations

from collections.abc import Iterable

from nereus.config import require

__all__ = ["AUTO", "DTYPES", "resolve_dtype"]

AUTO = "auto"
DTYPES = ("float32", "bfloat16")
GPU_KINDS = ("cuda",)


def resolve_dtype(requested: str, device_kinds: Iterable[str]) -> str:
    """The dtype a job computes in: ``requested`` unless it is ``auto``; then bfloat16
    where every device in ``device_kinds`` (``DeviceInfo.kind``: ``cuda``, ``cpu``) is a
    GPU, else float32."""
    require(
        requested == AUTO or requested in DTYPES,
        "model.dtype",
        requested,
        f"must be {AUTO!r} or one of {list(DTYPES)}",
    )
    if requested != AUTO:
        return requested
    kinds = set(device_kinds)
    require(
        bool(kinds), "device_kinds", sorted(kinds), "must name the job's devices to resolve 'auto'"
    )
    return "bfloat16" if kinds <= set(GPU_KINDS) else "float32"
