"""What every multi-process benchmark does: take the slowest rank's figure, and run its ranks, then
print the table and write the JSON and the chart."""
from __future__ import annotations

import sys
from typing import Any, Callable


def max_over_ranks(value: float) -> float:
    """`value` on the slowest rank (an all-reduce of one float64 over the default group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def launch_and_report(command: str, worker: Callable, options: Any, result: Callable[[Any], dict],
                      format_table: Callable[[dict], str], plot: Callable[[dict, str], None] | None) -> int:
    """Run `worker(rank, options)` on `options.world_size` gloo processes; `result(rank 0's return)`
    is printed with `format_table`, written to `options.json_path` and drawn to `options.png_path`.
    Returns the exit code (1 when a rank failed, said as `command: ...` on stderr)."""
    from hotswitch.distributed.launch import LaunchError, launch
    from hotswitch.progress import write_json

    try:
        value = launch(worker, options.world_size, options, backend="gloo")
    except LaunchError as e:
        print(f"{command}: {e}", file=sys.stderr, flush=True)
        return 1
    out = result(value)
    print(format_table(out))
    write_json(options.json_path, out)
    if options.png_path and plot is not None:
        plot(out, options.png_path)
    print(f"wrote {', '.join(p for p in (options.json_path, options.png_path) if p)}")
    return 0
