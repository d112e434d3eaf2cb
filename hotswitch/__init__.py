"""hotswitch: compile a model once for several parallel layouts and switch between them while training.

    import hotswitch as hs
    cm = hs.compile(model, example_inputs, ["dp4", "dp2tp2", "tp4sp"])   # ExecGraphs per config
    trainer = hs.Trainer(model, ["dp=4", "tp=4,sp"])                      # mixed-length training
    hs.launch(fn, 4)                                                      # fn(rank) on 4 processes
    hs.search_configs(model, world_size=4, lengths=[64, 1024])            # Pareto configs per length

Sub-packages follow the data flow, each importing only those before it: `distconfig` (layouts as
values), `kernels`, `compiler` (trace, propagate, lower), `switch` (plan and execute switches),
`search` (config candidates: Pareto sets per length), `runtime` (CompiledModel, pipeline schedules),
`train` (Trainer, data, cost model), `elastic`, `bench`, `cli`. Every name loads on first use:
`import hotswitch` imports nothing else (not even torch), so `hotswitch --help` is quick and
`hotswitch plan` never imports the compiler.
"""

__all__ = ["CompiledModel", "DistConfig", "StepReport", "Topology", "Trainer", "compile", "elastic", "launch",
           "models", "search_configs"]

_LAZY = {  # public name -> (module, attribute or None for the module itself)
    "DistConfig": ("hotswitch.distconfig", "DistConfig"),
    "Topology": ("hotswitch.distconfig", "Topology"),
    "compile": ("hotswitch.runtime.compiled_model", "compile"),
    "CompiledModel": ("hotswitch.runtime.compiled_model", "CompiledModel"),
    "Trainer": ("hotswitch.train.trainer", "Trainer"),
    "StepReport": ("hotswitch.train.trainer", "StepReport"),
    "launch": ("hotswitch.distributed.launch", "launch"),
    "models": ("hotswitch.models", None),
    "elastic": ("hotswitch.elastic", None),
    "search_configs": ("hotswitch.search", "search_configs"),
}


_SUBPACKAGES = ("bench", "cli", "compiler", "distconfig", "distributed", "elastic", "kernels", "models", "runtime",
                "switch", "train")


def __getattr__(name):
    import importlib

    if name in _SUBPACKAGES and name not in _LAZY:  # `hs.distconfig.Shard` without importing it first
        return importlib.import_module(f"hotswitch.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'hotswitch' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    return value if attribute is None else getattr(value, attribute)


def __dir__():
    return sorted(set(globals()) | set(__all__))
