"""Progress lines for long phases (tracing, lowering each config and shape, profiling), each with the
seconds since the command started: `[   12.3 s] lowering dp2tp2 ...`. Plain lines work on a
terminal and in a log alike; `hs.compile(..., progress=Progress())` and the Trainer take one.
`write_json` writes a command's results where its --json option says."""
from __future__ import annotations

import json
import time

__all__ = ["Progress", "write_json"]


def write_json(path: str | None, value) -> None:
    """`value` as JSON to the file `path`, to standard output for "-", nowhere for None."""
    if not path:
        return
    if path == "-":
        print(json.dumps(value, indent=1, default=str), flush=True)
        return
    with open(path, "w") as f:
        json.dump(value, f, indent=1, default=str)


class Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)
