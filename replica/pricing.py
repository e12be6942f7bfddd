"""A real replica's step prices, measured from its own steps: what it puts on its load reports
(`protocol.cost.StepPricing`) so a router that predicts latency prices its queue at its real
speed, as a fake replica's stated cost model lets it price that one's.

A fake runner states its prices (`step_cost`); a real model's depend on the machine, the
dtype, the threads and the kernels it chose, so the engine fits them instead: every step's
work (`protocol.cost.StepFeatures`) and the seconds it took go into a window of recent steps,
and every `refit_every` steps the window is fitted again by non-negative least squares
(`protocol.cost.fit_linear_cost`, the fit the simulator's calibration uses). A step the loop
went on from at once is timed from its start to the next step's start, so the serving loop's
own work between steps (scheduling, sampling, streaming) is priced with it, as the router's
walk of the queue, one step after another, needs; a step followed by an idle wait is timed by
its own duration. Until `min_samples` steps are in, the replica reports no pricing and the
router uses its fallback."""

from __future__ import annotations

from collections import deque

from protocol.cost import MAX_LOOP_GAP, LinearCostModel, StepFeatures, StepPricing, fit_linear_cost
from protocol.records import StepRecord

WINDOW = 512  # recent steps a fit reads: long enough to see prefill and decode mixes, short enough to follow a change
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
        self.samples: deque[tuple[StepFeatures, float]] = deque(maxlen=window)
        self.pricing: StepPricing | None = None
        self._last: StepRecord | None = None
        self._since_fit = 0

    def observe(self, step: StepRecord) -> None:
        """Record a step; the one before it is priced now that the loop's gap after it is known."""
        last, self._last = self._last, step
        if last is None:
            return
        gap = step.start - (last.start + last.duration)
        seconds = step.start - last.start if 0 <= gap < MAX_LOOP_GAP else last.duration
        self.samples.append((StepFeatures.of_row(vars(last)), seconds))
        self._since_fit += 1
        if len(self.samples) >= self.min_samples and self._since_fit >= self.refit_every:
            self.pricing = StepPricing(self.fit(), self.token_budget)
            self._since_fit = 0

    def fit(self) -> LinearCostModel:
        return fit_linear_cost(self.samples)
