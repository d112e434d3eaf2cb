"""Test-session setup: runs before any test module (and so before any Triton kernel) is imported.

- ``TRITON_INTERPRET``: without a CUDA GPU, 1: Triton kernels run on CPU through the interpreter;
  with one, 0: they are compiled for the GPU and tests/test_kernels.py's GPU test runs natively. It
  must be set before a kernel is defined; an exported value wins.
- ``OMP_NUM_THREADS=1``: tests spawn several worker processes on small machines; one thread each.
- ``TORCHINDUCTOR_VEC_ISA_OK=0``: Inductor writes scalar C++ for the CPU (no SIMD variants of each
  kernel): the checks compare hotswitch's compiled graphs with eager ones, not Inductor's vectorizer,
  and its codegen takes a third of the time (a 2-layer GPT's step graph: 25 s -> 16 s measured).
- ``HOTSWITCH_CACHE_DIR``: a fresh directory per test session, so the suite starts with a cold
  compile cache (never the user's) and later modules reuse what earlier ones decided.
- ``-n auto --dist loadgroup`` (pytest-xdist, the README's command) runs one worker per core this
  process may use, at most 4, each test module on one worker, except that the modules whose tests
  run gloo processes through ``tests.distributed`` form one group, on one worker, run first: one
  after another (two such runs at once on 2 cores cost 12% more CPU, measured) while the other
  workers take the single-process modules, which fill the cores a run leaves idle while one of its
  ranks traces a model or starts up. (With ``--dist loadfile`` such a worker would sit blocked on
  the run lock below instead: 136 s of a 421 s suite, measured.)
- ``HOTSWITCH_TEST_RUN_LOCK``: a lock file, so that one multi-process run happens at a time however
  the modules are spread over workers.
- The repository root goes on ``sys.path`` so that ``import tests.distributed``, ``hotswitch`` etc.
  work without an install. Worker processes spawned by ``tests.distributed`` inherit both the
  environment and ``sys.path``.
"""

import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: OpenMP reads it when loaded
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")  # before Inductor's config is imported (it reads it then)
if "TRITON_INTERPRET" not in os.environ:
    import torch

    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"
if "HOTSWITCH_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["HOTSWITCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="hotswitch-test-cache-")
if "HOTSWITCH_TEST_RUN_LOCK" not in os.environ:  # one multi-process run at a time (tests/distributed.py)
    os.environ["HOTSWITCH_TEST_RUN_LOCK"] = os.path.join(os.environ["HOTSWITCH_CACHE_DIR"], "multi-process-run.lock")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, never called
def pytest_xdist_auto_num_workers(config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


_MULTI_PROCESS_GROUP = "gloo runs"
_GROUP_FIRST = pytest.StashKey[bool]()


def _runs_processes(module) -> bool:
    """Whether a test module starts gloo processes through the harness (it imports one of its runners)."""
    from tests import distributed

    return any(getattr(module, name, None) is getattr(distributed, name)
               for name in ("run_checks", "dist_tests", "dist_fixture"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the groups into node ids
def pytest_collection_modifyitems(config, items):
    """Each module one xdist group (``--dist loadgroup`` then spreads modules, as loadfile would),
    the modules that start gloo processes one group between them, first in the queue."""
    for item in items:
        module = getattr(item, "module", None)
        runs = module is not None and _runs_processes(module)
        item.add_marker(pytest.mark.xdist_group(_MULTI_PROCESS_GROUP if runs else item.nodeid.split("::")[0]))
        item.stash[_GROUP_FIRST] = runs
    items.sort(key=lambda item: not item.stash[_GROUP_FIRST])  # stable: modules keep their order inside

