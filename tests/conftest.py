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
- ``-n auto --dist loadfile`` (pytest-xdist; ``pyproject.toml``'s addopts, so plain ``pytest`` does it;
  ``-n 0``: one process) runs one worker per core this
  process may use, at most 4, each test module on one worker, except that the modules whose tests
  run gloo processes through ``tests.distributed`` are one unit of work, run first and one after
  another (two runs at once on 2 cores cost 12% more CPU, measured) while the other workers take the
  single-process modules, which fill the cores a run leaves idle while one of its ranks traces a
  model or starts up (see ``pytest_xdist_make_scheduler``).
- ``HOTSWITCH_TEST_RUN_LOCK``: a lock file, so that one multi-process run happens at a time however
  the modules are spread over workers.
- The repository root goes on ``sys.path`` so that ``import tests.distributed``, ``hotswitch`` etc.
  work without an install. Worker processes spawned by ``tests.distributed`` inherit both the
  environment and ``sys.path``.
"""

import functools
import os
import re
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


_MULTI_PROCESS_MODULES = "modules that start gloo processes"
_RUNNERS = re.compile(r"\b(run_checks|dist_tests|dist_fixture)\b")


def unit_of_work(root, module: str) -> str:
    """The xdist unit of work of test module `module` (a path relative to `root`): the module, or one
    unit for all modules that start gloo processes through the harness (they name one of its runners)."""
    path = root / module
    return _MULTI_PROCESS_MODULES if path.is_file() and _RUNNERS.search(path.read_text()) else module


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, called in the controlling process
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, except that the modules starting gloo processes are one unit of work
    (`unit_of_work`): one worker runs them one after another, first (xdist queues the unit with the
    most tests first), while the other workers take the single-process modules. Under plain
    loadfile a worker given such a module sits blocked on the run lock while another runs: 136 s of
    a 421 s suite, measured. Other --dist modes: xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    unit = functools.cache(functools.partial(unit_of_work, config.rootpath))

    class _GlooRunsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(super()._split_scope(nodeid))

    return _GlooRunsTogether(config, log)
