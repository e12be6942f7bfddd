"""What splitting the replicas into prefill and decode pools bought, and where: per point of the
sweep an experiment compares colocated serving with disaggregation on (its workload, load,
batching and routing), the best colocated row (no prefill pool, any token budget and slot
count) against the best split row (any P:D split, budget and slots), each the best by median
goodput over seeds, since each arrangement is offered the same knobs and should be judged at
its best. The two rows ran the same traffic seed by seed, so the line gives each seed's ratio,
and the lead holds only when the winner is ahead on every seed: one seed's traffic can favour
either side at saturation."""

from __future__ import annotations

import statistics

from experiments.plan import AXES
from experiments.run import ExperimentResult
from experiments.scaling_report import Row

KNOBS = ("token_budget", "slots", "pools")  # what each arrangement is tuned over, the best kept


def against_colocated(result: ExperimentResult, rows: list[Row]) -> list[str]:
    """One line per point of the sweep with both colocated and split rows (see the module
    docstring): the winner on median goodput, its ratio to the other, the ratio seed by seed,
    and whether the lead holds on every seed. Empty when no row has pools."""
    groups: dict[tuple, dict[bool, list[Row]]] = {}
    for r in rows:
        if r.values["goodput"]:
            key = tuple(getattr(r.cell, a) for a in AXES if a not in KNOBS)
            split = result.plan.pools(r.cell) is not None
            groups.setdefault(key, {False: [], True: []})[split].append(r)
    varied = [a for a in AXES if a not in KNOBS and len({getattr(r.cell, a) for r in rows}) > 1]
    lines = []
    for by_kind in groups.values():
        if not by_kind[False] or not by_kind[True]:
            continue
        best = {k: max(by_kind[k], key=_goodput) for k in (False, True)}
        split_wins = _goodput(best[True]) > _goodput(best[False])
        ahead, behind = best[split_wins], best[not split_wins]
        theirs = behind.per_seed("goodput")
        seeds = [(a, theirs[s]) for s, a in ahead.per_seed("goodput").items() if s in theirs]
        verdict = ""
        if len(seeds) > 1:
            verdict = "; holds on every seed" if all(a > b for a, b in seeds) else "; does not hold on every seed"
        where = " ".join(f"{a}={getattr(ahead.cell, a)}" for a in varied)
        lines.append(
            f"{where + ': ' if where else ''}{'split' if split_wins else 'colocated'} wins, {_setting(ahead)} "
            f"{_goodput(ahead):.1f} good tok/s = {_ratio(_goodput(ahead), _goodput(behind))} the best "
            f"{'colocated' if split_wins else 'split'}, {_setting(behind)} {_goodput(behind):.1f}; "
            f"by seed {' / '.join(_ratio(a, b) for a, b in seeds)}{verdict}"
        )
    return lines


def _goodput(row: Row) -> float:
    return statistics.median(row.values["goodput"])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "inf x"


def _setting(row: Row) -> str:
    c = row.cell
    budget = "" if c.token_budget is None else f"budget {c.token_budget}, "
    return f"({f'pools {c.pools}, ' if c.pools else ''}{budget}{c.slots} slots)"
