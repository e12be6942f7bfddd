"""A routing comparison's verdict from repeated runs: per policy the median goodput and TTFT p99
over its rounds with their spread (max - min), the winner on each, by how much over the
runner-up, and whether the lead holds beyond the spread: the winner's worst round beats every
other policy's best round. `slotserve run` gives each round its own seed (its own traffic), so
a lead that holds there holds across arrival sequences, not only across reruns of one. One line
a person can act on, under a small table.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

Figure = Callable[[dict], float]

GOODPUT: Figure = lambda a: a["cluster"]["goodput"]  # noqa: E731 - a named figure
TTFT_P99: Figure = lambda a: a["cluster"]["ttft"]["p99"] or 0.0  # noqa: E731


def _stats(runs: list[dict], figure: Figure) -> tuple[float, float]:
    values = [figure(a) for a in runs]
    return statistics.median(values), max(values) - min(values)


def _seeds(runs: list[dict]) -> list[int]:
    return sorted({a["seed"] for a in runs if a.get("seed") is not None})


def rounds(by_policy: dict[str, list[dict]]) -> str:
    """'3 seeds (0, 1, 2)' when the rounds had different traffic, else '3 rounds'."""
    count = min(len(r) for r in by_policy.values())
    seeds = _seeds([a for runs in by_policy.values() for a in runs])
    return f"{count} seeds ({', '.join(map(str, seeds))})" if len(seeds) > 1 else f"{count} rounds"


@dataclass
class Lead:
    """The winner on a figure against the runner-up: their medians over rounds and spreads
    (max - min), the winner's ratio over the runner-up (higher is better for both sides of it:
    a latency's ratio is the runner-up's over the winner's), and the policies whose best round
    reached the winner's worst (none: the lead holds)."""

    first: str
    second: str
    medians: tuple[float, float]
    spreads: tuple[float, float]
    ratio: float
    reached: list[str]


def lead(by_policy: dict[str, list[dict]], figure: Figure, higher_is_better: bool) -> Lead:
    """The winner on `figure` (best median) and its lead over the runner-up (two policies or more)."""
    sign = 1 if higher_is_better else -1
    ranked = sorted(by_policy, key=lambda p: -sign * _stats(by_policy[p], figure)[0])
    first, second = ranked[0], ranked[1]
    (a, spread_a), (b, spread_b) = _stats(by_policy[first], figure), _stats(by_policy[second], figure)
    ratio = (a / b if b else float("inf")) if higher_is_better else (b / a if a else float("inf"))
    worst = min(sign * figure(x) for x in by_policy[first])
    reached = [p for p in ranked[1:] if max(sign * figure(x) for x in by_policy[p]) >= worst]
    return Lead(first, second, (a, b), (spread_a, spread_b), ratio, reached)


def _lead(by_policy: dict[str, list[dict]], figure: Figure, higher_is_better: bool) -> str:
    """The lead of `lead` in words: the medians, the ratio, the spreads and whether it holds."""
    won = lead(by_policy, figure, higher_is_better)
    if won.reached:
        how = f"within noise: {' and '.join(won.reached)} reached its worst of {rounds(by_policy)}"
    else:
        how = f"holds: its worst of {rounds(by_policy)} beats every other policy's best"
    (a, b), (spread_a, spread_b) = won.medians, won.spreads
    return (
        f"{won.first} {a:.3g} vs {won.second} {b:.3g}, {won.ratio:.2f}x {'higher' if higher_is_better else 'lower'} "
        f"(spreads {spread_a:.3g} / {spread_b:.3g}; {how})"
    )


def verdict_table(by_policy: dict[str, list[dict]]) -> str:
    """Per policy: median (spread) of goodput and TTFT p99 over its rounds, and their seeds."""
    lines = [f"{'routing':<18}{'good tok/s':>22}{'TTFT p99 s':>22}  rounds (seeds)"]
    for policy, runs in by_policy.items():
        cells = [f"{m:>12.2f} ({s:6.2f})" for m, s in (_stats(runs, GOODPUT), _stats(runs, TTFT_P99))]
        seeds = ", ".join(map(str, _seeds(runs)))
        lines.append(f"{policy:<18}{cells[0]:>22}{cells[1]:>22}  {len(runs)} ({seeds})")
    return "\n".join(lines)


def verdict_line(by_policy: dict[str, list[dict]]) -> str:
    """'verdict: goodput: X ... ; TTFT p99: Y ...' (see the module docstring)."""
    if len(by_policy) < 2:
        return "verdict: one policy only, nothing to compare"
    goodput, ttft = _lead(by_policy, GOODPUT, True), _lead(by_policy, TTFT_P99, False)
    return f"verdict: goodput (tok/s): {goodput}; TTFT p99 (s): {ttft}"
