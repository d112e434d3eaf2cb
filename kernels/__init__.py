"""kernels: Triton kernels for switching state, with torch fallbacks (imports torch and triton only),
and the document-causal attention op.

`pack` gathers many strided slices into one contiguous send buffer (fused cast); `unpack` scatters a
received buffer into place (fused cast or fused accumulate). See `kernels.pack` for the design.
`kernels.attention` defines `torch.ops.hotswitch.document_attention` (imported on first use: models
reach it when given document ids), whose mask comes from document ids and positions.
"""

from .pack import BACKENDS, HAS_TRITON, INTERPRET, cast, pack, pack_kernels, packed_numel, unpack

__all__ = ["BACKENDS", "HAS_TRITON", "INTERPRET", "cast", "pack", "pack_kernels", "packed_numel", "unpack"]
