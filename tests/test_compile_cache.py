"""The persistent compile cache (pure: no process group): round trips, corrupt and truncated entries
recovered from, concurrent writers, and the environment switches."""
import os
import threading
import warnings

import pytest

from hotswitch.compiler.cache import DecisionCache, default_cache
from hotswitch.compiler.lower import ShardingDecisions

DECISIONS = ShardingDecisions({"mm": (((("S", 0),), (("R",),)), (("P", "sum"),))}, frozenset({"add_3"}))


def test_round_trip_and_keys(tmp_path):
    cache = DecisionCache(tmp_path)
    key = cache.key("graph code", (2, 2), ("dp", "tp"))
    assert key != cache.key("graph code", (4,), ("tp",)) and key == cache.key("graph code", (2, 2), ("dp", "tp"))
    assert cache.get(key) is None and cache.misses == 1
    cache.put(key, DECISIONS)
    assert cache.get(key) == DECISIONS and cache.hits == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_entry_is_reported_once_removed_and_recomputed(tmp_path, damage):
    cache = DecisionCache(tmp_path)
    key = cache.key("g")
    cache.put(key, DECISIONS)
    path = next(tmp_path.rglob("*.pkl"))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "flip": data[:-1] + bytes([data[-1] ^ 1]),
                      "garbage": b"not a cache entry"}[damage])
    with pytest.warns(UserWarning, match="corrupt or truncated.*removed and recomputed"):
        assert cache.get(key) is None
    assert not path.exists() and cache.recovered == 1
    cache.put(key, DECISIONS)  # the recomputed decisions take its place
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(key) == DECISIONS


def test_concurrent_writers_leave_a_whole_entry(tmp_path):
    cache = DecisionCache(tmp_path)
    key = cache.key("g")
    big = ShardingDecisions({f"n{i}": ((("R",),), ("R",)) for i in range(20000)}, frozenset())
    threads = [threading.Thread(target=cache.put, args=(key, big)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert DecisionCache(tmp_path).get(key) == big
    assert [p.name for p in tmp_path.rglob("*")  if p.is_file()] == [f"{key}.pkl"]  # no temporary file left


def test_environment_chooses_the_directory_or_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTSWITCH_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache().directory == tmp_path / "here"
    monkeypatch.delenv("HOTSWITCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache().directory == tmp_path / "xdg" / "hotswitch"
    monkeypatch.setenv("HOTSWITCH_CACHE", "0")
    assert default_cache() is None
    assert os.environ["HOTSWITCH_CACHE"] == "0"
