"""Config order per step: the cheapest cycle through the configs a step visits.

A step starts in the `base` config (the one holding fp32 master weights and running the optimizer),
visits every other config once, and returns to the base. The first switch of a step carries
weights only (no gradients have been accumulated yet), so it costs less than the others; the cost
function is told which switch is the first. HotSPa hard-codes base -> shortest bucket -> ... -> base;
we search: exactly (all orders) for up to `EXACT_LIMIT` configs, and beyond with networkx's
greedy directed traveling-salesman tour (the cost may be asymmetric), improved by an iterated local
search (Or-opt and 2-opt moves, seeded double-bridge kicks); deterministic either way.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms import approximation as nx_approx

__all__ = ["EXACT_LIMIT", "OrderPlan", "cycle_cost", "plan_order"]

EXACT_LIMIT = 8  # configs, base included: 7! = 5040 orders
KICKS = 30  # perturbations of the approximate tour


@dataclass(frozen=True, slots=True)
class OrderPlan:
    """`order` starts with the base and lists each config once; the step returns to order[0] after it.

    `cost` includes that return switch. `exact` says whether the order is proven cheapest.
    """

    order: tuple[str, ...]
    cost: float
    exact: bool

    def switches(self) -> list[tuple[str, str, bool]]:
        """The step's switches as (from, to, first), the return to the base included."""
        if len(self.order) < 2:
            return []
        cycle = self.order + self.order[:1]
        return [(a, b, i == 0) for i, (a, b) in enumerate(zip(cycle, cycle[1:]))]


def cycle_cost(order: Sequence[str], cost: Callable[[str, str, bool], float]) -> float:
    """Cost of visiting `order` from order[0] and returning to it (the first switch flagged)."""
    if len(order) < 2:
        return 0.0
    cycle = list(order) + [order[0]]
    return float(sum(cost(a, b, i == 0) for i, (a, b) in enumerate(zip(cycle, cycle[1:]))))


def plan_order(
    configs: Sequence[str],
    cost: Callable[[str, str, bool], float],
    base: str | None = None,
) -> OrderPlan:
    """The cheapest cycle from `base` (default configs[0]) through every config and back.

    `cost(a, b, first)` is the cost of switching from a to b; `first` is True for the first switch
    of a step. A base not among `configs` is added (a step always ends in it for the optimizer).
    Repeated names count once. Deterministic: ties keep the earliest order in `configs` order.
    """
    if isinstance(configs, str):
        raise ValueError(f"plan_order takes a list of config names, got the string {configs!r}")
    names = list(dict.fromkeys(configs))
    if not names and base is None:
        raise ValueError("plan_order needs at least one config name (or a base)")
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"config names must be strings, got {names!r}")
    base = names[0] if base is None else base
    others = [n for n in names if n != base]
    if not others:
        return OrderPlan((base,), 0.0, True)
    # each switch's cost once: the tour search asks for them many times
    table = {(a, b): float(cost(a, b, a == base)) for a in [base, *others] for b in [base, *others] if a != b}

    def priced(a: str, b: str, first: bool) -> float:
        return table[(a, b)]

    if len(others) + 1 <= EXACT_LIMIT:
        best, best_cost = None, float("inf")
        for perm in itertools.permutations(others):
            c = cycle_cost((base, *perm), priced)
            if c < best_cost:
                best, best_cost = perm, c
        return OrderPlan((base, *best), best_cost, True)

    order = _approximate(base, others, table)
    return OrderPlan(order, cycle_cost(order, priced), False)


def _approximate(base: str, others: list[str], table: dict[tuple[str, str], float]) -> tuple[str, ...]:
    """networkx's greedy directed tour, improved by iterated local search; the base stays first."""
    graph = nx.DiGraph()
    nodes = [base, *others]
    graph.add_nodes_from(nodes)
    for (a, b), w in table.items():
        graph.add_edge(a, b, weight=w)

    def tour_cost(cycle: list[str]) -> float:
        return sum(table[(a, b)] for a, b in zip(cycle, cycle[1:]))

    cycle = nx_approx.greedy_tsp(graph, weight="weight", source=base)
    assert cycle[0] == cycle[-1] == base and sorted(cycle[:-1]) == sorted(nodes), "networkx returned a bad tour"
    # iterated local search: polish, then kick (a seeded double bridge) and polish again, keep the best
    best = _or_opt(cycle[:-1], table)
    best_cost = tour_cost([*best, base])
    rng = random.Random(0)
    current = best
    for _ in range(KICKS):
        i, j, k = sorted(rng.sample(range(1, len(current)), 3))  # > EXACT_LIMIT configs: room for 3 cuts
        kicked = _or_opt([*current[:i], *current[j:k], *current[i:j], *current[k:]], table)
        c = tour_cost([*kicked, base])
        if c <= tour_cost([*current, base]):
            current = kicked
        if c < best_cost - 1e-12:
            best, best_cost = kicked, c
    return best


def _or_opt(order: list[str], table: dict[tuple[str, str], float]) -> tuple[str, ...]:
    """Polish a tour until no single move helps: move a segment of any length elsewhere (Or-opt,
    orientation kept: fits asymmetric costs) or reverse a segment (2-opt). The base stays first."""

    def cost(o: list[str]) -> float:
        return sum(table[(a, b)] for a, b in zip(o, o[1:] + o[:1]))

    def neighbours(o: list[str]):
        n = len(o)
        for i in range(1, n):
            for k in range(i + 1, n + 1):
                segment, rest = o[i:k], o[:i] + o[k:]
                for j in range(1, len(rest) + 1):
                    if j != i:
                        yield rest[:j] + segment + rest[j:]
                if k - i > 1:
                    yield o[:i] + segment[::-1] + o[k:]

    best, best_cost = list(order), cost(order)
    improved = True
    while improved:
        improved = False
        for candidate in neighbours(best):
            c = cost(candidate)
            if c < best_cost - 1e-12:
                best, best_cost, improved = candidate, c, True
                break
    return tuple(best)
