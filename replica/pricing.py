"""A real replica's step prices, measured from its own steps: what it puts on its load reports
(`protocol.cost.StepPricing`) so a router that predicts latency prices its queue at its real
speed, as a fake replica's stated cost model lets it price that one's.

A fake runner states its prices (`step_cost`); a real model's depend on the machine, the
dtype, the threads and the kernels it chose, so the engine fits them instead: every step's
work (`protocol.cost.StepFeatures`) and the seconds it took go into a window of recent steps,
and every `refit_every` steps the window is fitted again by non-negative least squares
(`protocol.cost.fit_linear_cost`, the fit the simulator's calibration uses). The window keeps
the recent steps that prefilled apart from those that only decoded, so a long run of decode
alone does not forget what a prompt costs (a feature that never varies in the window would be
fitted as free). A step the loop went on from at once is timed from its start to the next
step's start, so the serving loop's own work between steps (scheduling, sampling, streaming) is
priced with it, as the router's walk of the queue, one step after another, needs; a step after
which the engine had nothing left, or the loop waited, is timed by its own duration. Until
`min_samples` steps are in, the replica reports no pricing and the router uses its fallback.
A fake runner's stated prices leave that loop work out: `LoopGap` measures it beside them, and
the engine states it with them (`StepPricing.loop_overhead`)."""

from __future__ import annotations

import itertools
from collections import deque

from protocol.cost import MAX_LOOP_GAP, LinearCostModel, StepFeatures, StepPricing, fit_linear_cost
from protocol.records import StepRecord

LOOP_GAP_WEIGHT = 0.05  # weight of each new gap in the running mean: a few dozen steps, steady against one stall
WINDOW = 512  # recent steps a fit reads, of each kind: enough to see the mixes, short enough to follow a change
MIN_SAMPLES = 32  # steps before the first fit
REFIT_EVERY = 32  # steps between fits


class MeasuredPricing:
    """The step prices fitted to the engine's recent steps; `pricing` is None until the first fit."""

    def __init__(
        self,
        token_budget: int | None,
        window: int = WINDOW,
        min_samples: int = MIN_SAMPLES,
        refit_every: int = REFIT_EVERY,
    ):
        self.token_budget = token_budget
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.prefills: deque[tuple[StepFeatures, float]] = deque(maxlen=window)
        self.decodes: deque[tuple[StepFeatures, float]] = deque(maxlen=window)
        self.pricing: StepPricing | None = None
        self._last: tuple[StepRecord, bool] | None = None
        self._since_fit = 0

    def observe(self, step: StepRecord, goes_on: bool) -> None:
        """Record a step (`goes_on`: the engine had work left after it); the one before it is
        priced now that the loop's gap after it is known."""
        last, self._last = self._last, (step, goes_on)
        if last is None:
            return
        before, went_on = last
        seconds = step.start - before.start if loop_gap(before, went_on, step) is not None else before.duration
        features = StepFeatures.of_row(vars(before))
        (self.prefills if features.prefill_tokens else self.decodes).append((features, seconds))
        self._since_fit += 1
        if len(self.prefills) + len(self.decodes) >= self.min_samples and self._since_fit >= self.refit_every:
            self.pricing = StepPricing(self.fit(), self.token_budget)
            self._since_fit = 0

    def fit(self) -> LinearCostModel:
        return fit_linear_cost(list(itertools.chain(self.prefills, self.decodes)))


class LoopGap:
    """The serving loop's own seconds between two steps run back to back (from one step's end
    to the next one's start: its tokens out, the load report, the inbox, a fake step's sleep
    overshoot), a running mean; 0 until two such steps have run. A gap after which the engine
    had nothing left, or of `MAX_LOOP_GAP` or more (an idle wait), is not the loop's work."""

    def __init__(self, weight: float = LOOP_GAP_WEIGHT):
        self.weight = weight
        self.seconds = 0.0
        self._seen = False
        self._last: tuple[StepRecord, bool] | None = None

    def observe(self, step: StepRecord, goes_on: bool) -> None:
        """Record a step (`goes_on`: the engine had work left after it)."""
        last, self._last = self._last, (step, goes_on)
        gap = None if last is None else loop_gap(*last, step)
        if gap is not None:
            self.seconds = gap if not self._seen else self.seconds + self.weight * (gap - self.seconds)
            self._seen = True


def loop_gap(before: StepRecord, went_on: bool, step: StepRecord) -> float | None:
    """The serving loop's own seconds from the end of `before` to the start of `step`, the next
    one; None where that was no loop work: the engine had nothing left after `before`
    (`went_on` False), or the gap is `MAX_LOOP_GAP` or more (an idle wait)."""
    gap = step.start - (before.start + before.duration)
    return gap if went_on and 0 <= gap < MAX_LOOP_GAP else None
