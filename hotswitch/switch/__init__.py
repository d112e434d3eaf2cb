"""Hot switching: which slice of which tensor goes from which device to which, and doing it.

`planner` (pure, numpy: finest common slicing, greedy sender choice, lower bounds), `order` (the
cheapest cycle through a step's configs), `executor` (the runtime: packed per-peer buffers, one
batched point-to-point exchange, atomic commit), `cluster` and `simulate` (layouts of large models
described without weights, and a cluster simulator, for planning at 1024 devices on a laptop).
Everything but the executor is pure: no process group.
"""
