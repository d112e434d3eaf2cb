"""Tests of the multi-process harness in tests/distributed.py (gloo, world sizes 2 and 4)."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import dist_fixture, dist_tests, run_checks

# ---------------------------------------------------------------- checks (run in the workers)

_STATE: list[str] = []  # module state in a worker: persists from one check to the next


def check_environment():
    _STATE.append("environment")
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {k: os.environ.get(k) for k in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "TRITON_INTERPRET", "HARNESS_EXTRA")},
        "threads": torch.get_num_threads(),
        "random": torch.rand(3),  # reseeded before every check
        "pid": os.getpid(),
    }


def check_all_reduce():
    _STATE.append("all_reduce")
    x = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    return x


def check_fails_on_rank_1():
    _STATE.append("fails")
    x = torch.ones(2)
    dist.all_reduce(x)  # every rank takes part in the collective, then rank 1 fails
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return "fine"


def check_assert_values():
    value = dist.get_rank() + 1
    assert value == 1, "only rank 0 passes"  # rewritten: the message shows the values
    return value


def check_desync():
    # Rank 1 skips a collective that rank 0 enters: rank 0 times out (after 1 s), the default
    # group is out of step, and the harness must rebuild it before the next check.
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=1))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return "skipped the collective"


def check_fails_while_a_peer_waits():
    # Rank 1 fails before the send rank 0 waits for: its failing closes its group, so rank 0's recv
    # fails at once (a connection closed), not after the collective timeout (600 s by default)
    if dist.get_rank() == 1:
        raise ValueError("boom before sending")
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(2), src=1)
    return "not waiting"


def check_after_failures():
    _STATE.append("after")
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return {"sum": x.item(), "state": list(_STATE), "pid": os.getpid(), "random": torch.rand(3)}


def check_unpicklable():
    return lambda: None


def check_needs_a_gpu():
    """A GPU-only check, as the harness runs them: without a GPU it skips, and that skip must reach
    its test; with one it runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return float(torch.ones(2, device="cuda").sum())


# ----------------------------------------------------------------------- world size 4, fixture

CHECKS_4 = [
    check_environment,
    check_all_reduce,
    check_fails_on_rank_1,
    check_assert_values,
    check_desync,
    check_fails_while_a_peer_waits,
    check_after_failures,
    check_unpicklable,
    check_needs_a_gpu,
]
results = dist_fixture(4, CHECKS_4, env={"HARNESS_EXTRA": "yes"})


def test_results_cover_all_checks(results):
    assert list(results) == [c.__name__ for c in CHECKS_4]
    assert all(len(r.values) == len(r.errors) == 4 for r in results.values())


def test_worker_environment(results):
    values = results["check_environment"].raise_if_failed()
    port = values[0]["env"]["MASTER_PORT"]
    for rank, v in enumerate(values):
        assert (v["rank"], v["world_size"], v["backend"], v["threads"]) == (rank, 4, "gloo", 1)
        assert v["env"] == {
            "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), "HARNESS_EXTRA": "yes",
        }
        torch.manual_seed(0)
        torch.testing.assert_close(v["random"], torch.rand(3))
    assert len({v["pid"] for v in values}) == 4


def test_all_reduce_values_per_rank(results):
    r = results["check_all_reduce"]
    values = r.raise_if_failed()
    assert r.ok and r.errors == [None] * 4
    assert [v.item() for v in values] == [10.0] * 4
    assert all(s is not None and s >= 0 for s in r.rank_seconds) and r.seconds == max(r.rank_seconds)


def test_failure_on_one_rank_is_reported_with_traceback(results):
    r = results["check_fails_on_rank_1"]
    assert not r.ok and r.failed_ranks == [1] and r.status == ["ok", "fail", "ok", "ok"]
    assert r.values == ["fine", None, "fine", "fine"]
    assert r.errors[0] is None and r.errors[2] is None and r.errors[3] is None
    assert "Traceback" in r.errors[1] and "ValueError: boom on rank 1" in r.errors[1]
    assert "check_fails_on_rank_1" in r.errors[1]  # the frame of the check
    with pytest.raises(AssertionError) as info:
        r.raise_if_failed()
    message = str(info.value)
    assert "'check_fails_on_rank_1' failed on rank(s) [1] of world size 4" in message
    assert "rank 1" in message and "ValueError: boom on rank 1" in message


def test_assertions_in_workers_show_values(results):
    r = results["check_assert_values"]
    assert r.failed_ranks == [1, 2, 3] and r.values[0] == 1
    assert "only rank 0 passes" in r.errors[1] and "assert 2 == 1" in r.errors[1]
    assert "assert 4 == 1" in r.errors[3]


def test_desync_fails_the_check_and_the_group_is_rebuilt(results):
    r = results["check_desync"]
    assert r.failed_ranks == [0] and "Timed out" in r.errors[0]
    after = results["check_after_failures"].raise_if_failed()  # collectives work again
    assert [v["sum"] for v in after] == [6.0] * 4


def test_a_failing_rank_fails_its_waiting_peer_at_once(results):
    r = results["check_fails_while_a_peer_waits"]
    assert r.failed_ranks == [0, 1] and r.values[2:] == ["not waiting"] * 2
    assert "ValueError: boom before sending" in r.errors[1]
    error = r.errors[0].lower()
    assert "timed out" not in error and ("closed" in error or "reset" in error), r.errors[0]
    results["check_after_failures"].raise_if_failed()  # on a new group


def test_checks_share_one_process_per_rank(results):
    before = results["check_environment"].raise_if_failed()
    after = results["check_after_failures"].raise_if_failed()
    assert [v["pid"] for v in after] == [v["pid"] for v in before]
    assert all(v["state"] == ["environment", "all_reduce", "fails", "after"] for v in after)
    torch.testing.assert_close(after[0]["random"], before[0]["random"])  # reseeded per check


def test_unpicklable_value_fails_the_check(results):
    r = results["check_unpicklable"]
    assert r.failed_ranks == [0, 1, 2, 3]
    assert "not picklable" in r.errors[0]
    assert "(same error)" in r.report()  # identical tracebacks are printed once


def test_a_skip_in_a_check_reaches_its_test(results):
    r = results["check_needs_a_gpu"]
    assert r.ok and r.errors == [None] * 4
    if torch.cuda.is_available():  # it ran: nothing skipped
        assert not r.skipped and r.values == [2.0] * 4
        assert r.raise_if_failed() == [2.0] * 4
        return
    assert r.skipped == "needs a CUDA GPU" and r.status == ["skip"] * 4
    with pytest.raises(pytest.skip.Exception, match="needs a CUDA GPU"):
        r.raise_if_failed()


# ----------------------------------------------------------------- world size 2, generated tests

test_world2 = dist_tests(2, [check_all_reduce, check_after_failures])


# --------------------------------------------------------------- crashes and hangs end the run


def check_crash_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)


def check_hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(600)


def test_crashed_rank_ends_the_run_with_its_exit_code():
    # the errors say what ended the run (the exit, not the 60 s timeout); no wall-clock bound here: this
    # process may wait for the run lock (tests/conftest.py) as long as another module's run takes
    res = run_checks(2, [check_all_reduce, check_crash_on_rank_1, check_after_failures], timeout=60)
    assert [v.item() for v in res["check_all_reduce"].raise_if_failed()] == [3.0, 3.0]
    crash = res["check_crash_on_rank_1"]
    assert crash.failed_ranks == [1] and crash.errors[0] is None
    assert "rank 1 exited with code 3" in crash.errors[1]
    after = res["check_after_failures"]
    assert after.failed_ranks == [0, 1] and "no result: the run was aborted" in after.errors[0]
    assert crash.status == ["ok", "missing"] and after.status == ["missing", "missing"]


def test_hung_check_ends_the_run_at_check_timeout():
    checks = [check_all_reduce, check_hang_on_rank_0, check_after_failures]  # the first syncs the ranks
    res = run_checks(2, checks, timeout=60, check_timeout=1)  # the error names check_timeout, not the 60 s
    res["check_all_reduce"].raise_if_failed()
    hang = res["check_hang_on_rank_0"]
    assert hang.failed_ranks == [0] and hang.errors[1] is None
    assert "ran over check_timeout=1 s on rank 0" in hang.errors[0]
    assert "rank 1: done with check 'check_hang_on_rank_0', waiting" in hang.errors[0]
    assert not res["check_after_failures"].ok


def test_checks_must_be_module_level_or_picklable():
    with pytest.raises(ValueError, match="module-level"):
        run_checks(2, [lambda: None])
    with pytest.raises(ValueError, match="unique"):
        run_checks(2, [check_all_reduce, check_all_reduce])


def test_modules_starting_gloo_processes_are_one_unit_of_work(pytestconfig):
    """Under `-n auto --dist loadfile` (tests/conftest.py) the modules that start gloo processes run
    on one worker one after another; every other module is a unit of its own."""
    from tests.conftest import unit_of_work

    root = pytestconfig.rootpath
    gloo = unit_of_work(root, "tests/test_harness.py")
    assert unit_of_work(root, "tests/test_compile_world4.py") == unit_of_work(root, "tests/test_checkpoint.py") == gloo
    assert unit_of_work(root, "tests/test_trace.py") == "tests/test_trace.py" != gloo
    assert unit_of_work(root, "tests/test_elastic_world4.py") == "tests/test_elastic_world4.py"  # its own agent
