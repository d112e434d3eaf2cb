"""Progress lines for long phases (tracing, lowering each config and shape, profiling), each with the
seconds since the command started: `[   12.3 s] lowering dp2tp2 ...`. Plain lines work on a
terminal and in a log alike; `hs.compile(..., progress=Progress())` and the Trainer take one."""
from __future__ import annotations

import time

__all__ = ["Progress"]


class Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)
