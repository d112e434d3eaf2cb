"""The installed package as users and readers meet it: one top-level name, sub-packages that import
only downwards, a public namespace, and no change to torch behind the user's back."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

from tests.distributed import scaled

ROOT = Path(__file__).resolve().parent.parent
# Top-level folder (as installed: hotswitch.<name>) -> layer; a module may import only its own layer
# and those below it. `models` (built-in models) is plain torch; `distributed` starts processes.
LAYERS = [
    "distconfig",
    "kernels",
    "models",
    "distributed",
    "compiler",
    "switch",
    "search",
    "runtime",
    "train",
    "elastic",
    "bench",
    "cli",
]
FOLDERS = {"distconfig": ROOT / "distconfig", "kernels": ROOT / "kernels", "compiler": ROOT / "compiler"}


def _modules() -> dict[str, Path]:
    """hotswitch.* module name -> source file, with compiler/, distconfig/, kernels/ mapped in."""
    out = {}
    for path in (ROOT / "hotswitch").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        out[".".join(p for p in rel.parts if p != "__init__")] = path
    for name, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            out[".".join(["hotswitch", name, *[p for p in rel.parts if p != "__init__"]])] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every hotswitch module `module` imports (module level and inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_no_import_cycle_and_no_module_imports_a_higher_layer():
    modules = _modules()
    graph = nx.DiGraph()
    for module, path in modules.items():
        for target in _imports(module, path, set(modules)):
            graph.add_edge(module, target)
    inits = {m for m in modules if modules[m].name == "__init__.py"}
    cycles = [c for c in nx.simple_cycles(graph.subgraph(set(graph) - inits))]
    assert not cycles, f"import cycles: {cycles[:5]}"
    upward = [(a, b) for a, b in graph.edges if a not in ("hotswitch",) and _layer(a) is not None
              and _layer(b) is not None and _layer(b) > _layer(a)]
    assert not upward, f"modules importing a higher layer (order {LAYERS}): {upward}"


def _run_outside(code: str) -> subprocess.CompletedProcess:
    """Python in a directory outside the checkout, without the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, env=env,
                          timeout=scaled(300))


def test_one_top_level_name_and_every_module_imports_from_the_installed_package():
    """Outside the checkout, `kernels`, `compiler` and `distconfig` are not ours (they are
    hotswitch.kernels etc.), the public names resolve, every module imports without reaching for the
    old top-level names, and importing them all leaves DTensor's propagation as it was: hotswitch's
    policy is active inside its context manager only, restored after an error too (one interpreter:
    importing torch once per check costs suite time)."""
    names = sorted(m for m in _modules() if not m.endswith("__main__"))
    proc = _run_outside(
        "import importlib, importlib.util, sys\n"
        "from torch.distributed.tensor import _sharding_prop as sp\n"
        "from torch.distributed.tensor._ops import utils\n"
        "before = (sp._select_min_cost_strategy, utils.redistribute_cost)\n"
        "for name in ('kernels', 'compiler', 'distconfig'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    assert spec is None or 'hotswitch' not in str(spec.origin), (name, spec)\n"
        "import hotswitch as hs\n"
        "print(hs.compile.__module__, hs.Trainer.__name__, hs.models.__name__, hs.launch.__name__,"
        " hs.elastic.__name__, hs.DistConfig.__name__)\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('compiler', 'distconfig', 'kernels'))\n"
        "assert not bad, bad\n"
        "assert (sp._select_min_cost_strategy, utils.redistribute_cost) == before, 'changed by import'\n"
        "from hotswitch.compiler import _dtensor as dt\n"
        "assert dt.torch_functions() == before\n"
        "with dt.propagation() as memo:\n"
        "    inside = dt.torch_functions()\n"
        "assert inside[0] is not before[0] and inside[1] is not before[1], 'policy inactive inside'\n"
        "assert (sp._select_min_cost_strategy, utils.redistribute_cost) == before, 'not restored'\n"
        "try:\n"
        "    with dt.propagation():\n"
        "        raise KeyError('boom')\n"
        "except KeyError:\n"
        "    pass\n"
        "assert (sp._select_min_cost_strategy, utils.redistribute_cost) == before, 'not restored after an error'\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["hotswitch.runtime.compiled_model", "Trainer", "hotswitch.models", "launch",
                                   "hotswitch.elastic", "DistConfig"]


def test_kernels_in_the_repository_root_is_the_installed_package_of_that_name():
    """From the checkout's root (as `python -m pytest` and its spawned ranks run), `import kernels` is
    the installed top-level package of that name (transformers imports Hugging Face's `kernels`), not
    this repository's kernels/ folder, which is hotswitch.kernels; with none installed it is not found."""
    code = ("import importlib.util, sys\n"
            "sys.path.insert(0, {root!r})\n"
            "import hotswitch.kernels\n"
            "try:\n"
            "    import kernels\n"
            "except ModuleNotFoundError as e:\n"
            "    print('none', e.name)\n"
            "else:\n"
            "    print(kernels.__file__)\n"
            "print(hotswitch.kernels.pack.__module__)\n").format(root=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    found, ours = proc.stdout.split("\n")[:2]
    assert ours == "hotswitch.kernels.pack"
    assert found == "none kernels" or (found.endswith("__init__.py") and str(ROOT) not in found), found


def test_configs_parse_one_grammar():
    from hotswitch.distconfig import DistConfig

    assert (
        DistConfig.parse("dp2tp2sp") == DistConfig.parse("dp=2,tp=2,sp") == DistConfig("dp2tp2sp", dp=2, tp=2, sp=True)
    )
    assert DistConfig.parse("tp2pp2") == DistConfig.parse("tp=2,pp=2")
    assert DistConfig.parse(DistConfig("x", dp=2)) == DistConfig("x", dp=2)
    with pytest.raises(ValueError, match="compact name, e.g. 'dp4'.*key=value pairs"):
        DistConfig.parse("dp2banana")
    with pytest.raises(ValueError, match="a DistConfig or a config string"):
        DistConfig.parse(4)


def test_importing_hotswitch_imports_no_torch():
    """`import hotswitch`, its config grammar and the CLI's parsers load neither torch nor the compiler,
    so `hotswitch --help` starts in a fraction of a second; names resolve on first use."""
    proc = _run_outside(
        "import sys\n"
        "import hotswitch as hs, hotswitch.distconfig, hotswitch.cli\n"
        "c = hs.DistConfig.parse('dp=2,tp=2,sp')\n"
        "c.compute_mesh(); hs.Topology.from_env(4); hotswitch.distconfig.Shard(0)\n"
        "heavy = sorted(m for m in ('torch', 'hotswitch.compiler', 'hotswitch.runtime') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert hs.distconfig.to_torch(hs.distconfig.Shard(1)).dim == 1 and 'torch' in sys.modules\n"
        "assert hs.compile.__module__ == 'hotswitch.runtime.compiled_model'\n")
    assert proc.returncode == 0, proc.stderr
