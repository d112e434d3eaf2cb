"""Pack many strided sub-blocks into one contiguous 1-D buffer, and unpack a buffer back into place.

A switch sends one fused buffer per peer: `pack` gathers every slice bound for that peer (each a
view of some tensor, any strides, up to 4 dims after merging) into one buffer, with an optional
fused cast (bf16 compute weights out of fp32 masters, say); `unpack` scatters a received buffer into
the destination views, casting to each target's dtype, or adding into them (`accumulate=True`, the
fused accumulate for gradient buffers).

**Triton kernel.** A call launches once per element type of the slices (a pointer's element type
is compile-time) and tile shape. Slices may come from different tensors, so the kernel reads a
descriptor table, one int64 row per slice: the offset of its first element from a base tensor of the
launch (in elements), its sizes and strides padded to 4 dims, its offset in the buffer, its first
tile and its tiles per row. A program copies one tile of `TILE` elements: rows (runs of the innermost
dim) x columns, the columns a power of two covering the run. Indices are unravelled per row, not per
element, and where every row starts 16-byte aligned (checked on the host) the compiler is told so and
moves 16-byte vectors. Each program loads (from the strided view or the buffer), casts, and stores
(adding first when accumulating).

**Torch fallback.** The same API with `copy_` per slice; results are bit-identical to the kernel:
a cast is one rounding (to nearest even) in both, and an accumulate is `(target + piece)` computed
in `torch.promote_types(target, buffer, float32)` and rounded once to the target's dtype.

**Backend.** `backend="auto"` runs Triton on CUDA tensors and torch on CPU, except that with
`TRITON_INTERPRET=1` in the environment at import time Triton runs on CPU tensors through its
interpreter (how the tests exercise the kernel; it is slow). `HOTSWITCH_PACK_BACKEND=torch|triton`
overrides what "auto" picks; `backend="triton"|"torch"` forces one per call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # triton ships for Linux only
    HAS_TRITON = False

__all__ = ["BACKENDS", "HAS_TRITON", "INTERPRET", "cast", "pack", "pack_kernels", "packed_numel", "unpack"]

BACKENDS = ("auto", "triton", "torch")
# Read once: the interpreter has to be chosen before the kernels below are defined.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
TILE = 4096  # elements per program
NUM_WARPS = 4
MAX_DIMS = 4
_NCOL = 12  # descriptor row: offset from the base tensor, 4 sizes, 4 strides, buffer offset, first tile, column tiles

SliceSpec = tuple[torch.Tensor, tuple[slice, ...]]


# ---------------------------------------------------------------- kernels

if HAS_TRITON:
    _TL_DTYPES = {
        torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64, torch.int8: tl.int8, torch.uint8: tl.uint8, torch.int16: tl.int16,
        torch.int32: tl.int32, torch.int64: tl.int64,
    }

    @triton.jit
    def _tile(desc, tile_slice, R: tl.constexpr, C: tl.constexpr, ALIGN: tl.constexpr, NCOL: tl.constexpr):
        """This program's tile of its slice: R rows (each a run of the innermost dim) x C columns. The
        row index is unravelled per row, never per element (64-bit division per element made the
        kernel compute-bound). Returns the elements' offsets from the launch's base tensor, their
        positions in the buffer, and the mask."""
        pid = tl.program_id(0)
        row = desc + tl.load(tile_slice + pid).to(tl.int64) * NCOL
        s1 = tl.load(row + 2)
        s2 = tl.load(row + 3)
        s3 = tl.multiple_of(tl.load(row + 4), ALIGN)  # said so, the column mask is constant per vector
        col_tiles = tl.load(row + 11)
        t = pid - tl.load(row + 10)
        r = (t // col_tiles) * R + tl.arange(0, R)
        c = (t % col_tiles) * C + tl.arange(0, C)
        i2 = r % s2
        q = r // s2
        # offsets in elements; ALIGN: the host checked that every row starts ALIGN-aligned (16 bytes)
        row_at = tl.multiple_of(tl.load(row) + (q // s1) * tl.load(row + 5) + (q % s1) * tl.load(row + 6)
                                + i2 * tl.load(row + 7), ALIGN)
        packed_at = tl.multiple_of(tl.load(row + 9) + r * s3, ALIGN)
        mask = (r < tl.load(row + 1) * s1 * s2)[:, None] & (c < s3)[None, :]
        if ALIGN > 1:  # the innermost stride is 1 (checked): contiguous runs the compiler can vectorize
            strided = row_at[:, None] + c[None, :]
        else:
            strided = row_at[:, None] + c[None, :] * tl.load(row + 8)
        return strided, packed_at[:, None] + c[None, :], mask

    @triton.jit
    def _pack_kernel(desc, tile_slice, base, out, R: tl.constexpr, C: tl.constexpr, ALIGN: tl.constexpr,
                     NCOL: tl.constexpr):
        strided, packed, mask = _tile(desc, tile_slice, R, C, ALIGN, NCOL)
        x = tl.load(base + strided, mask=mask)
        tl.store(out + packed, x.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _unpack_kernel(
        desc, tile_slice, base, buf, ACCUMULATE: tl.constexpr, COMPUTE: tl.constexpr,
        R: tl.constexpr, C: tl.constexpr, ALIGN: tl.constexpr, NCOL: tl.constexpr,
    ):
        strided, packed, mask = _tile(desc, tile_slice, R, C, ALIGN, NCOL)
        dst = base + strided
        x = tl.load(buf + packed, mask=mask)
        if ACCUMULATE:
            x = tl.load(dst, mask=mask).to(COMPUTE) + x.to(COMPUTE)
        tl.store(dst, x.to(base.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- host side


def _view(spec: SliceSpec, what: str, i: int) -> torch.Tensor:
    try:
        tensor, index = spec
    except (TypeError, ValueError):
        raise ValueError(f"{what}[{i}] must be a (tensor, tuple of slices) pair, got {spec!r}") from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what}[{i}] must start with a torch.Tensor, got {type(tensor).__name__}")
    view = tensor[tuple(index)]
    if view.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
        raise ValueError(f"{what}[{i}]: index {index!r} does not give a view; use slices (start:stop:step)")
    return view


def _dims(view: torch.Tensor, what: str, i: int) -> tuple[list[int], list[int]]:
    """Sizes and strides of `view` with size-1 dims dropped, mergeable dims merged, padded to 4 dims."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    if len(sizes) > MAX_DIMS:
        raise ValueError(
            f"{what}[{i}] is a view of shape {tuple(view.shape)} and strides {view.stride()} that stays "
            f"{len(sizes)}-dimensional after merging; the kernel handles {MAX_DIMS} dims: split it into "
            "several slices"
        )
    pad = MAX_DIMS - len(sizes)
    return [1] * pad + sizes, [0] * pad + strides


def _choose(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = os.environ.get("HOTSWITCH_PACK_BACKEND", "").strip() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"HOTSWITCH_PACK_BACKEND must be 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        use = HAS_TRITON and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))
        return "triton" if use else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise ValueError("backend='triton' but triton is not installed; use backend='torch'")
        if device.type == "cpu" and not INTERPRET:
            raise ValueError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing kernels, or use backend='torch'"
            )
    return backend


def _same_device(views: list[torch.Tensor], device: torch.device, what: str) -> None:
    for i, v in enumerate(views):
        if v.device != device:
            raise ValueError(f"{what}[{i}] is on {v.device} but the buffer is on {device}; keep them on one device")


class _Launch(NamedTuple):
    """One kernel launch over slices of one dtype, tile shape and alignment (see `_plans`)."""
    desc: torch.Tensor  # one descriptor row per slice
    tile_slice: torch.Tensor  # the slice of each tile (program)
    tiles: int
    base: torch.Tensor  # the tensor the rows' offsets count from
    rows: int
    cols: int
    align: int

    def __call__(self, kernel, buffer: torch.Tensor, **meta) -> None:
        kernel[(self.tiles,)](self.desc, self.tile_slice, self.base, buffer, R=self.rows, C=self.cols,
                              ALIGN=self.align, NCOL=_NCOL, num_warps=NUM_WARPS, **meta)


def _launch(kernel, views: list[torch.Tensor], offsets: list[int], what: str, buffer: torch.Tensor, **meta) -> None:
    """The launches over `views` (all of one dtype); view i sits at `offsets[i]` in `buffer`."""
    for launch in _plans(views, offsets, what, buffer):
        launch(kernel, buffer, **meta)


def _tile_shape(inner: int) -> tuple[int, int]:
    """Rows x columns of a program's tile for slices whose innermost run is `inner` elements: columns
    cover the run (a power of two, 16 to TILE), rows fill the tile."""
    cols = min(TILE, max(16, 1 << (inner - 1).bit_length()))
    return TILE // cols, cols


def _alignment(offset: int, sizes: list[int], strides: list[int], packed_at: int, widest: int) -> int:
    """The largest power of two (elements, at most 16 bytes of the wider of the two dtypes) dividing
    every row start of the slice, in its tensor and in the buffer: the kernel may then load and store
    16-byte vectors. 1 when the innermost stride is not 1."""
    if strides[-1] != 1:
        return 1
    values = [offset, packed_at, sizes[-1]] + [st for n, st in zip(sizes[:-1], strides[:-1]) if n > 1]
    align = max(1, 16 // widest)
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def _plans(views: list[torch.Tensor], offsets: list[int], what: str, buffer: torch.Tensor) -> list[_Launch]:
    """The launches over `views` (all of one dtype), tables on the buffer's device: views of one tile
    shape and alignment share a launch. Refuses a dtype the kernels do not handle."""
    live = [(i, v, o) for i, (v, o) in enumerate(zip(views, offsets)) if v.numel()]
    if not live:
        return []
    base = live[0][1]
    for dtype in (base.dtype, buffer.dtype):
        _tl(dtype)
    elsize = base.element_size()
    widest = max(elsize, buffer.element_size())
    aligned_bases = base.data_ptr() % 16 == 0 and buffer.data_ptr() % 16 == 0
    groups: dict[tuple[int, int], tuple[list, list]] = {}  # (columns, alignment) -> descriptor rows, tile counts
    totals: dict[tuple[int, int], int] = {}
    for i, v, packed_at in live:
        sizes, strides = _dims(v, what, i)
        delta = v.data_ptr() - base.data_ptr()
        if delta % elsize:
            raise ValueError(f"{what}[{i}] is not aligned to its {v.dtype} elements; make it contiguous first")
        offset = delta // elsize
        rows, cols = _tile_shape(sizes[-1])
        align = _alignment(offset, sizes, strides, packed_at, widest) if aligned_bases else 1
        table, tiles = groups.setdefault((cols, align), ([], []))
        col_tiles = -(-sizes[-1] // cols)
        count = -(-(v.numel() // sizes[-1]) // rows) * col_tiles
        first = totals.get((cols, align), 0)
        table.append([offset, *sizes, *strides, packed_at, first, col_tiles])
        tiles.append(count)
        totals[cols, align] = first + count
    plans = []
    for (cols, align), (table, tiles) in groups.items():
        desc = torch.tensor(table, dtype=torch.int64)
        tile_slice = torch.repeat_interleave(torch.arange(len(table), dtype=torch.int32), torch.tensor(tiles))
        if buffer.device.type != "cpu":  # from pageable memory: staged before the call returns (temporaries may go)
            desc = desc.to(buffer.device, non_blocking=True)
            tile_slice = tile_slice.to(buffer.device, non_blocking=True)
        plans.append(_Launch(desc, tile_slice, totals[cols, align], base, TILE // cols, cols, align))
    return plans


def _by_dtype(views: list[torch.Tensor]) -> dict[torch.dtype, tuple[list[torch.Tensor], list[int]]]:
    """Views grouped by dtype (first-seen order), each with its offset in the packed buffer."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
    offset = 0
    for v in views:
        group = groups.setdefault(v.dtype, ([], []))
        group[0].append(v)
        group[1].append(offset)
        offset += v.numel()
    return groups


def _tl(dtype: torch.dtype):
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"the Triton pack kernels do not handle {dtype}; use backend='torch'") from None


def packed_numel(slices: Sequence[SliceSpec]) -> int:
    """Elements `pack(slices)` produces."""
    return sum(_view(s, "slices", i).numel() for i, s in enumerate(slices))


def pack(
    slices: Sequence[SliceSpec],
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Copy the sub-blocks `tensor[slices]` one after another into one contiguous 1-D buffer.

    The buffer's dtype is `dtype`, else `out.dtype`, else the tensors' common dtype (each piece is
    cast on the way). `out`, if given, must be a contiguous 1-D tensor of exactly the packed size.
    """
    views = [_view(s, "slices", i) for i, s in enumerate(slices)]
    total = sum(v.numel() for v in views)
    if out is not None:
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"pack got dtype={dtype} but out has dtype {out.dtype}; give one or make them agree")
        if out.dim() != 1 or not out.is_contiguous() or out.numel() != total:
            raise ValueError(
                f"pack's out must be a contiguous 1-D tensor of {total} elements, got shape "
                f"{tuple(out.shape)} (contiguous={out.is_contiguous()})"
            )
        dtype = out.dtype
    elif dtype is None:
        dtypes = {v.dtype for v in views}
        if len(dtypes) > 1:
            raise ValueError(f"pack's slices have dtypes {sorted(map(str, dtypes))}; pass dtype= for the buffer")
        dtype = dtypes.pop() if dtypes else torch.float32
    device = out.device if out is not None else (views[0].device if views else torch.device("cpu"))
    _same_device(views, device, "slices")
    if out is None:
        out = torch.empty(total, dtype=dtype, device=device)
    if _choose(backend, device) == "torch":
        offset = 0
        for v in views:
            n = v.numel()
            out[offset:offset + n].view(v.shape).copy_(v)
            offset += n
        return out
    for group, offsets in _by_dtype(views).values():  # launches per source element type
        _launch(_pack_kernel, group, offsets, "slices", out)
    return out


def cast(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, backend: str = "auto") -> dict[str, torch.Tensor]:
    """Every tensor cast to `dtype` by one `pack` (bf16 compute weights from fp32 masters after an
    optimizer step: one kernel launch per source dtype on a GPU instead of one per tensor). The results
    are views of one contiguous buffer, bit-identical to `t.to(dtype)`."""
    names = list(tensors)
    flat = [tensors[n].reshape(-1) for n in names]  # a view where contiguous: no copy before the kernel
    buffer = pack([(t, ()) for t in flat], dtype=dtype, backend=backend)
    out, offset = {}, 0
    for n, t in zip(names, flat):
        out[n] = buffer[offset:offset + t.numel()].view(tensors[n].shape)
        offset += t.numel()
    return out


def pack_kernels(slices: Sequence[SliceSpec], out: torch.Tensor) -> Callable[[], None]:
    """`pack(slices, out=out, backend="triton")` with its descriptor tables built once: a call runs the
    kernels alone (what a switch whose tables were cached would launch). For measuring the kernels
    apart from the Python that describes the slices (`hotswitch bench gpu`)."""
    views = [_view(s, "slices", i) for i, s in enumerate(slices)]
    if sum(v.numel() for v in views) != out.numel():
        raise ValueError(f"pack_kernels: the slices hold {sum(v.numel() for v in views)} elements, out {out.numel()}")
    _choose("triton", out.device)
    _same_device(views, out.device, "slices")
    launches = [launch for group, offsets in _by_dtype(views).values()
                for launch in _plans(group, offsets, "slices", out)]

    def run() -> None:
        for launch in launches:
            launch(_pack_kernel, out)

    return run


def _compute_dtype(target: torch.dtype, buf: torch.dtype) -> torch.dtype:
    promoted = torch.promote_types(target, buf)
    return torch.promote_types(promoted, torch.float32) if promoted.is_floating_point else promoted


def unpack(
    buf: torch.Tensor,
    targets: Sequence[SliceSpec],
    accumulate: bool = False,
    backend: str = "auto",
) -> None:
    """Write consecutive pieces of the 1-D `buf` into the views `tensor[slices]` of `targets`, in place.

    Each piece is cast to its target's dtype; with `accumulate=True` it is added to the target
    instead (in `promote_types(target, buf, float32)`, rounded once). Targets must not overlap.
    """
    if not isinstance(buf, torch.Tensor) or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"unpack's buf must be a contiguous 1-D tensor, got {getattr(buf, 'shape', buf)!r}")
    views = [_view(s, "targets", i) for i, s in enumerate(targets)]
    total = sum(v.numel() for v in views)
    if total != buf.numel():
        raise ValueError(f"unpack's targets hold {total} elements but buf has {buf.numel()}; they must match")
    _same_device(views, buf.device, "targets")
    if _choose(backend, buf.device) == "torch":
        offset = 0
        for v in views:
            n = v.numel()
            piece = buf[offset:offset + n].view(v.shape)
            if accumulate:
                compute = _compute_dtype(v.dtype, buf.dtype)
                v.copy_(v.to(compute) + piece.to(compute))
            else:
                v.copy_(piece)
            offset += n
        return
    for dst_dtype, (group, offsets) in _by_dtype(views).items():  # launches per target element type
        meta = {"ACCUMULATE": bool(accumulate), "COMPUTE": _tl(_compute_dtype(dst_dtype, buf.dtype))}
        _launch(_unpack_kernel, group, offsets, "targets", buf, **meta)
