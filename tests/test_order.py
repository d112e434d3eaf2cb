"""Config order: exact search against brute force, the approximation beyond, the first-switch discount."""

import itertools

import numpy as np
import pytest

from hotswitch.switch.order import EXACT_LIMIT, OrderPlan, cycle_cost, plan_order


def matrix_cost(names, seed, first_discount=0.5):
    rng = np.random.default_rng(seed)
    m = rng.uniform(1, 100, size=(len(names), len(names)))  # asymmetric
    index = {n: i for i, n in enumerate(names)}

    def cost(a, b, first):
        return m[index[a], index[b]] * (first_discount if first else 1.0)

    return cost


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("seed", range(5))
def test_exact_is_cheapest_of_all_cycles(n, seed):
    names = [f"c{i}" for i in range(n)]
    cost = matrix_cost(names, seed)
    plan = plan_order(names, cost)
    assert plan.exact and plan.order[0] == "c0" and sorted(plan.order) == names
    assert plan.cost == pytest.approx(cycle_cost(plan.order, cost))
    brute = min(cycle_cost(("c0", *p), cost) for p in itertools.permutations(names[1:]))
    assert plan.cost <= brute + 1e-9


def test_first_switch_is_flagged_and_changes_the_order():
    # a -> b is cheap only as a first switch (weights only); b -> a costly as a return
    table = {("base", "a"): 10, ("base", "b"): 10, ("a", "b"): 1, ("b", "a"): 1, ("a", "base"): 1, ("b", "base"): 20}
    seen = []

    def cost(x, y, first):
        seen.append((x, y, first))
        return table[(x, y)] / (10 if first else 1)

    plan = plan_order(["base", "a", "b"], cost)
    assert plan.order == ("base", "b", "a") and plan.cost == pytest.approx(1 + 1 + 1)
    assert all(first == (x == "base") for x, y, first in seen)
    assert plan.switches() == [("base", "b", True), ("b", "a", False), ("a", "base", False)]


def test_base_argument_and_trivial_cases():
    cost = matrix_cost(["x", "y", "z"], 1)
    plan = plan_order(["x", "y", "z"], cost, base="z")
    assert plan.order[0] == "z" and sorted(plan.order) == ["x", "y", "z"]
    assert plan_order(["x"], cost) == OrderPlan(("x",), 0.0, True)
    assert plan_order(["x", "x"], cost).order == ("x",)
    added = plan_order(["y", "z"], cost, base="x")  # the base joins the cycle
    assert added.order[0] == "x" and sorted(added.order) == ["x", "y", "z"]
    with pytest.raises(ValueError, match="list of config names"):
        plan_order("xyz", cost)
    with pytest.raises(ValueError, match="at least one"):
        plan_order([], cost)


@pytest.mark.parametrize("seed", range(3))
def test_approximation_beyond_exact_limit_returns_a_valid_cycle(seed):
    names = [f"c{i}" for i in range(10)]
    assert len(names) > EXACT_LIMIT
    cost = matrix_cost(names, seed)
    plan = plan_order(names, cost)
    assert not plan.exact
    assert plan.order[0] == "c0" and sorted(plan.order) == sorted(names)
    assert plan.cost == pytest.approx(cycle_cost(plan.order, cost))
    # no worse than the listed order, and deterministic
    assert plan.cost <= cycle_cost(names, cost) + 1e-9
    assert plan_order(names, cost) == plan


def test_approximation_finds_the_obvious_ring():
    names = [f"c{i}" for i in range(12)]
    ring = {(names[i], names[(i + 1) % 12]) for i in range(12)}

    def cost(a, b, first):
        return 1.0 if (a, b) in ring else 50.0

    plan = plan_order(names, cost)
    assert plan.order == tuple(names) and plan.cost == 12.0
