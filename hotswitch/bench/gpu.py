"""`hotswitch bench gpu`: what one GPU says about the GPU path (one GPU is enough).

(a) **pack / unpack bandwidth.** The Triton kernels gather many strided slices into one buffer per
    peer (and scatter a received buffer back). For 1k-100k slices of 4 KB-4 MB (at most
    `--max-bytes` moved per case) the bench times `pack` and `unpack` and divides their bandwidth
    (bytes read + written) by the device's copy bandwidth measured in the same run (one large
    `copy_` of as many bytes). Each result is checked equal to the torch fallback first.
(b) **one rank's training step** of a Llama-shaped model (~1.1B parameters by default) in bf16,
    under each config (dp8, tp8, dp2tp4), as rank 0 of a fake process group (collectives return
    without communicating, `hotswitch.runtime.profile`): the ExecGraph eager and compiled by
    Inductor, against the Hugging Face model in eager mode at the same local input shape. Reported:
    tokens/s and model FLOPs utilisation (6 x parameters x tokens, divided by the model-parallel
    degree, over the device's bf16 peak).
(c) **peak memory** of each step against the compiler's estimate (`compiler/memory.py` plus the
    resident weights, buffers and batch).

`--dry-run` checks the configuration (configs parse, fit the world size, divide the heads; the
model's parameter count on the meta device) and exits without a GPU, saying so. Results go to
`--json` and a short table.
"""
from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass, field

import torch

__all__ = ["GpuBenchOptions", "run"]

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=4096)
# dense bf16 tensor-core peaks (FLOP/s) for MFU; unknown devices report MFU as None
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


@dataclass(frozen=True)
class GpuBenchOptions:
    configs: tuple[str, ...] = ("dp8", "tp8", "dp2tp4")
    seq_len: int = 2048
    micro_batch: int = 1  # rows per data-parallel replica
    vocab_size: int = 32000
    model: dict = field(default_factory=lambda: dict(LLAMA_1B))
    slice_counts: tuple[int, ...] = (1_000, 10_000, 100_000)
    slice_bytes: tuple[int, ...] = (4 << 10, 256 << 10, 4 << 20)
    max_bytes: int = 4 << 30  # bytes per pack case (slices x size above this are skipped; ~6x this is allocated)
    repeats: int = 10
    inductor: bool = True
    json_path: str = "bench_gpu.json"


def run(options: GpuBenchOptions, dry_run: bool = False, log=print) -> int:
    checked = check(options)
    log(f"hotswitch bench gpu: Llama-shaped model, {checked['parameters'] / 1e9:.2f}B parameters, "
        f"configs {', '.join(checked['configs'])} (world size {checked['world_size']}), "
        f"sequence {options.seq_len}, {options.micro_batch} row(s) per replica")
    if dry_run:
        if torch.cuda.is_available():
            log(f"dry run: configuration checked; {torch.cuda.get_device_name()} is here, nothing measured")
        else:
            log("dry run: configuration checked; no CUDA GPU on this machine, nothing measured "
                "(run without --dry-run on a CUDA machine)")
        return 0
    if not torch.cuda.is_available():
        log("hotswitch bench gpu needs a CUDA GPU and torch.cuda.is_available() is False here; "
            "--dry-run checks the configuration without one")
        return 2
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "options": checked}
    log(f"device: {result['device']}")
    result["pack"] = pack_bandwidth(options, log)
    result["steps"] = rank_steps(options, checked, log)
    with open(options.json_path, "w") as f:
        json.dump(result, f, indent=2)
    log(f"wrote {options.json_path}")
    return 0


def check(options: GpuBenchOptions) -> dict:
    """The configuration, validated without a GPU: one world size, tp dividing the heads, the model's
    parameter count (built on the meta device)."""
    from hotswitch.distconfig import DistConfig

    configs = [DistConfig.parse(c) for c in options.configs]
    sizes = {c.world_size for c in configs}
    if len(sizes) != 1:
        raise ValueError(f"the configs must use one world size, got {sorted(sizes)} for {list(options.configs)}")
    heads, kv = options.model["num_attention_heads"], options.model.get("num_key_value_heads", 0)
    for c in configs:
        if c.pp > 1:
            raise ValueError(f"{c.name}: bench gpu profiles one rank of a single-stage program; use pp=1 configs")
        if heads % c.tp:
            raise ValueError(f"{c.name}: tp={c.tp} does not divide the model's {heads} attention heads")
    with torch.device("meta"):
        model = _build(options)
    return dict(configs=[c.name for c in configs], world_size=sizes.pop(), heads=heads, kv_heads=kv,
                parameters=sum(p.numel() for p in model.parameters()), seq_len=options.seq_len,
                micro_batch=options.micro_batch, model=dict(options.model), vocab_size=options.vocab_size)


def _build(options: GpuBenchOptions):
    from hotswitch.models import build_hf_model

    return build_hf_model("llama", vocab_size=options.vocab_size, **options.model)


# ----------------------------------------------------------------------------------- (a) pack


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def pack_bandwidth(options: GpuBenchOptions, log=print) -> list[dict]:
    """Pack and unpack of n strided row slices (every other row of a [2n, size] bf16 matrix), as a
    fraction of the copy bandwidth of the same bytes."""
    rows = []
    log("kernel: pack with its descriptor tables built once; pack, unpack: whole calls, tables built each time")
    log(f"{'slices':>8} {'slice':>8} {'MB':>8} {'copy GB/s':>10} {'kernel/copy':>11} {'pack/copy':>9} "
        f"{'unpack/copy':>11}")
    for n in options.slice_counts:
        for size in options.slice_bytes:
            if n * size > options.max_bytes:
                continue
            row = _pack_case(n, size, options.repeats)
            rows.append(row)
            log(f"{n:>8} {_size(size):>8} {row['bytes'] / 1e6:>8.1f} {row['copy_gbps']:>10.0f} "
                f"{row['kernel_fraction']:>11.2f} {row['pack_fraction']:>9.2f} {row['unpack_fraction']:>11.2f}")
            torch.cuda.empty_cache()
    return rows


def _pack_case(n: int, size: int, repeats: int) -> dict:
    from hotswitch.kernels import pack, pack_kernels, unpack

    cols = size // 2  # bf16
    source = torch.randn(2 * n, cols, device="cuda", dtype=torch.bfloat16)
    slices = [(source, (slice(2 * i, 2 * i + 1), slice(None))) for i in range(n)]
    out = torch.empty(n * cols, device="cuda", dtype=torch.bfloat16)
    pack(slices, out=out, backend="torch")
    reference = out.clone()
    pack(slices, out=out, backend="triton")
    if not torch.equal(out, reference):
        raise AssertionError(f"Triton pack differs from the torch fallback for {n} slices of {size} B")
    target = torch.zeros_like(source)
    targets = [(target, s) for _, s in slices]
    unpack(out, targets, backend="triton")
    if not torch.equal(target[::2], source[::2]) or target[1::2].any():
        raise AssertionError(f"Triton unpack did not restore {n} slices of {size} B")
    flat_src, flat_dst = source.view(-1)[: n * cols], torch.empty(n * cols, device="cuda", dtype=torch.bfloat16)
    moved = 2 * n * size  # read + write
    copy_s = _time(lambda: flat_dst.copy_(flat_src), repeats)
    kernels_s = _time(pack_kernels(slices, out), repeats)  # descriptor tables built once: the kernel alone
    pack_s = _time(lambda: pack(slices, out=out, backend="triton"), repeats)  # as a switch calls it
    unpack_s = _time(lambda: unpack(out, targets, backend="triton"), repeats)
    row = dict(slices=n, slice_bytes=size, bytes=n * size, copy_gbps=moved / copy_s / 1e9,
               kernel_gbps=moved / kernels_s / 1e9, pack_gbps=moved / pack_s / 1e9, unpack_gbps=moved / unpack_s / 1e9)
    row["kernel_fraction"] = row["kernel_gbps"] / row["copy_gbps"]
    row["pack_fraction"] = row["pack_gbps"] / row["copy_gbps"]
    row["unpack_fraction"] = row["unpack_gbps"] / row["copy_gbps"]
    return row


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


# ----------------------------------------------------------------------------------- (b), (c) steps


def rank_steps(options: GpuBenchOptions, checked: dict, log=print) -> list[dict]:
    """Rank 0's step under each config (ExecGraph eager and Inductor) vs the HF model eager at the same
    local shape, with measured and estimated peak memory."""
    from hotswitch.distconfig import DistConfig
    from hotswitch.runtime.profile import profile_rank

    world = checked["world_size"]
    peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
    build = functools.partial(_build_bf16, options)
    rows = []
    log(f"{'config':>8} {'graph':>9} {'local':>10} {'tokens/s':>10} {'MFU':>6} {'vs HF':>6} "
        f"{'peak GiB':>9} {'est GiB':>8} {'est/peak':>8}")
    for name in checked["configs"]:
        config = DistConfig.parse(name)
        batch = torch.randint(0, options.vocab_size, (options.micro_batch * config.dp, options.seq_len))
        rows_local = options.micro_batch
        hf_seconds = _hf_step_seconds(options, rows_local, options.repeats)
        torch.cuda.empty_cache()  # the profiling processes need the memory back
        hf_tokens_per_s = rows_local * options.seq_len / hf_seconds
        for backend in ("eager", "inductor") if options.inductor else ("eager",):
            p = profile_rank(build, (batch, batch), config, rank=0, repeats=options.repeats, device="cuda",
                             dtype=torch.bfloat16, backend=backend)
            row = dict(p.to_dict(), hf_eager_tokens_per_second=hf_tokens_per_s, world_size=world,
                       mfu=p.mfu(peak) if peak else None)
            # at equal work: a tp rank does 1/tp of the model's FLOPs for each of its tokens
            row["vs_hf"] = p.tokens_per_second / config.tp / hf_tokens_per_s
            rows.append(row)
            est, got = p.estimated_peak_bytes, p.peak_bytes
            log(f"{name:>8} {backend:>9} {'x'.join(map(str, p.local_shapes[0])):>10} {p.tokens_per_second:>10.0f} "
                f"{(row['mfu'] or float('nan')):>6.1%} {row['vs_hf']:>6.2f} {got / 2**30:>9.2f} {est / 2**30:>8.2f} "
                f"{est / got:>8.2f}")
    return rows


def _build_bf16(options: GpuBenchOptions):
    torch.manual_seed(0)
    return _build(options)


def _hf_step_seconds(options: GpuBenchOptions, rows: int, repeats: int) -> float:
    """The Hugging Face model's forward + backward in bf16 eager on this GPU at `rows` x seq_len."""
    torch.manual_seed(0)
    model = _build(options).to("cuda", torch.bfloat16)
    x = torch.randint(0, options.vocab_size, (rows, options.seq_len), device="cuda")

    def step():
        model(x, x).backward()
        model.zero_grad(set_to_none=True)

    return _time(step, repeats)
