"""kernels: Triton kernels for switching state, with torch fallbacks (imports torch and triton only).

`pack` gathers many strided slices into one contiguous send buffer (fused cast); `unpack` scatters a
received buffer into place (fused cast or fused accumulate). See `kernels.pack` for the design.
"""

from .pack import BACKENDS, HAS_TRITON, INTERPRET, cast, pack, pack_kernels, packed_numel, unpack

__all__ = ["BACKENDS", "HAS_TRITON", "INTERPRET", "cast", "pack", "pack_kernels", "packed_numel", "unpack"]
