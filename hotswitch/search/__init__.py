"""Automatic DistConfig candidates: price every config per length, keep the Pareto sets, choose a set.

    result = hs.search_configs(model, world_size=4, lengths=[64, 256, 1024], memory_budget_bytes=2**30)
    result.pareto[256]      # configs no other beats in both time and memory, fastest first
    result.chosen           # the configs to hot-switch between (HotSPa's objective, switching included)
    print(result.table()); result.plot("frontier.png")

`workload` reads the transformer's shape off the model, `space` enumerates and prunes the configs,
`cost` prices a config at a length (calibrated by measured micro-batches when given), `search` builds
the frontiers and chooses; `auto` measures a few configs on the running job for `Trainer(configs="auto")`.
Everything but `auto` is pure: no process group, so it plans for 1024 devices on a laptop.
"""
from .cost import Estimate, Hardware, Rates, calibrate, estimate
from .search import SearchResult, pareto_front, search_configs
from .space import Space, enumerate_configs
from .workload import Workload, describe_workload

__all__ = ["Estimate", "Hardware", "Rates", "SearchResult", "Space", "Workload", "calibrate", "describe_workload",
           "enumerate_configs", "estimate", "pareto_front", "search_configs"]
