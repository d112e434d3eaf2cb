"""kernels: Triton kernels for switching state, with torch fallbacks (imports torch and triton only),
and the document-causal attention op.

`pack` gathers many strided slices into one contiguous send buffer (fused cast); `unpack` scatters a
received buffer into place (fused cast or fused accumulate). See `kernels.pack` for the design.
`kernels.attention` defines `torch.ops.hotswitch.document_attention` (imported on first use: models
reach it when given document ids), whose mask comes from document ids and positions.

Installed, this folder is `hotswitch.kernels`. A process started in the repository's root (`python
-m pytest`, a test's spawned ranks) has the root on `sys.path`, where this folder would shadow the
top-level `kernels` package that Hugging Face `transformers` imports (its hub kernels): imported
under that name, this module hands the import over to the installed package of that name.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels' (this repository's kernels/ folder is hotswitch.kernels)",
                                  name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
else:
    from .pack import BACKENDS, HAS_TRITON, INTERPRET, cast, pack, pack_kernels, packed_numel, unpack

    __all__ = ["BACKENDS", "HAS_TRITON", "INTERPRET", "cast", "pack", "pack_kernels", "packed_numel", "unpack"]
