# Over 400 lines: the queue walk and the model that learns its corrections are one piece (the walk's
# stretches of decode steps must add up as its single steps do, beside the steps they stand for).
"""The model behind the `predicted_latency` routing policy (`router.policies.PredictedLatency`), after
llm-d's predicted-latency scorer: predict each replica's TTFT and TPOT for this request and send it
where the TTFT is lowest among the replicas whose TPOT meets the SLO (all of them, if none does).
The policy class lives with the others (`router.policies`, whose registry this module would
otherwise import in a circle); the prediction is here.

A prediction walks the replica's queue as the router knows it, one engine step at a time, the way
its scheduler would run it: the requests in flight there in dispatch order (one that no report of
the replica has listed yet is queued: it is on its way, or in the replica's inbox while a long step
runs; one listed before and not now has ended), the first of them holding slots: at most
`num_slots`, and no more than the replica's K/V budget holds (`LoadReport.kv_capacity_tokens`: with
long prompts a paged replica admits fewer requests than it has slots, and a walk that filled every
slot would miss the wait for K/V); each step runs a decode row for every slot past its prefill, then
prefill chunks within the replica's token budget; a request whose expected output
(`router.length_predictor.BucketedLength`) is made frees its slot for the next. A request's prefill
is its prompt less the prefix the replica holds (the precise block index kept from its K/V events
and the prompts in flight there, `PrecisePrefix.matched`; none on a replica that sends no K/V
events: it has no prefix cache), as it was at dispatch; one whose first token the last load report
shows is decoding, with the output still to come given what it has made, read off the recent
finished outputs that ran longer (`OutputResiduals`): the decoding rows of a replica are spread over
that distribution, so its first slot frees when the shortest of them is likely to end. A point
estimate per row (expected output less what it made) misses both ways: a row that has outlived its
estimate, as outputs with a heavy tail often do, looks a step from its end, and rows that each look
long hide that one of them is likely to end soon. The walk starts at that report, so the steps since
then count as past, and a request sent since joins it when it was sent. Each step is priced by the
replica's own cost model (`protocol.cost.StepPricing`, on its load reports), so replicas of
different speeds are told apart from their first report, and followed by the serving loop's own time
between steps where the replica states it apart (a fake one, whose stated prices are a step's work
alone); a real model reports the prices it measured from its own steps, the loop's time within them
(`replica.pricing`), once it has run a few dozen, and until then is priced by `DEFAULT_PRICING`,
which its correction scales to its speed.

The corrections: each replica's reports say how long its requests waited for their first token
(`LoadReport.ttft`), and the policy keeps, per replica, an exponentially weighted mean of
log(measured / predicted): what its pricing misses (a model's real speed, steps the walk does not
foresee). A TTFT counts from the client's send; where the request says when that was
(`RouteRequest.sent_at`), what it waited before the router saw it is taken off the measured TTFT the
correction learns from and added to the TTFT a decision records (`router.router._from_send`), so the
correction scales only what the walk prices. A request that found every slot held waited for one:
how long is a guess at the lengths ahead of it, not a price, so that part of its prediction
(`Prediction.slot_wait`) has its own correction, learned over every replica from such requests'
measured TTFT less their priced prefill, and leaves the replica's own. The TPOT has its own, learned
the same way from the decode its reports show: a request's time per token over its first
`TPOT_STEPS` tokens after the first, read off two reports' `tokens_made`, against the TPOT predicted
at its dispatch. The walk sees only the requests already routed, so it misses what decode pays for
the prompts routed there while the request runs (each prefill chunk lengthens a step of every
running row); a replica whose decode is near the TPOT limit (a slow one) passes the filter on the
walk alone and then misses it. Until a replica has shown a TPOT, its TTFT correction stands in for
both (a replica that reports no pricing is slower or faster as a whole). The predicted TTFT of the
chosen replica is what the decision records (`Decision.predicted_ttft`), and reports compare it with
the measured one (`metrics.goodput_report`: TTFT prediction MAPE).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from protocol import defaults
from protocol.cost import LinearCostModel, StepPricing
from protocol.messages import LoadReport
from protocol.routing import RouteRequest
from router.length_predictor import OutputResiduals
from router.load import ReplicaView

# A replica that reports no pricing yet: SmolLM2-135M's step costs as fitted on a 2-core CPU
# (`workloads/experiments/cost_model.json`); the correction scales it to the replica's speed.
DEFAULT_PRICING = StepPricing(
    LinearCostModel(c0=0.117, c_decode=0.00805, c_prefill=0.00387, c_ctx=4.0e-6, c_held=0.00845),
    defaults.TOKEN_BUDGET,
)
MAX_WALK_STEPS = 4096  # past it, the prediction is what the walk reached: behind any replica serving sooner
TPOT_STEPS = 16  # decode steps of the new request its predicted TPOT is the mean of
CORRECTION_WEIGHT = 0.1  # weight of each new error sample in a replica's running correction
MAX_ERROR_RATIO = 2.0  # one sample's measured / predicted is clipped to [1/x, x]: one stall moves it little


@dataclass
class _Placed:
    """A request in flight, as this policy placed it."""

    replica_id: str
    dispatched: float  # router clock
    prompt_len: int
    to_prefill: int  # prompt tokens outside the replica's cached prefix at dispatch
    cached: int  # prompt tokens inside it
    expected_output: float
    predicted_ttft: float  # before the correction: what the error is learned against
    predicted_tpot: float  # likewise
    predicted_wait: float  # the slot wait within predicted_ttft, likewise
    waited: float  # seconds from the client's send to the dispatch: in the measured TTFT, in no queue
    decode_seen: tuple[float, int] | None = None  # (report time, tokens made) of its first report decoding
    reported: bool = False  # a load report of its replica has listed it: absent from a later one, it ended


@dataclass(eq=False)
class _Row:
    """One request in the walk (compared by identity: two may hold the same counts)."""

    prefill_left: float
    context: float  # tokens whose K/V it holds
    decode_left: float
    shared: float = 0.0  # of `context`, the prefix it found cached (blocks other requests may hold too)
    ready: float = 0.0  # seconds after the report when it reached the replica (sent after the report was taken)

    def kv_need(self) -> float:
        """The K/V tokens it holds of its own once its prompt is in."""
        return self.context - self.shared + self.prefill_left


@dataclass(frozen=True)
class Prediction:
    ttft: float
    tpot: float
    slot_wait: float = 0.0  # the part of `ttft` spent queued for a slot (every slot held)


class LatencyModel:
    """The predictions and the corrections of `router.policies.PredictedLatency`: it hears of
    each dispatch, completion and load report, and scores replicas for a request."""

    def __init__(self, tpot_slo: float = defaults.TPOT_SLO):
        """`tpot_slo`: the TPOT a replica must be predicted to meet to be eligible."""
        self.tpot_slo = tpot_slo
        self._placed: dict[str, _Placed] = {}
        self._by_replica: dict[str, dict[str, _Placed]] = {}  # dispatch order
        self._log_error: dict[str, float] = {}  # replica -> running mean of log(measured / predicted TTFT)
        self._log_tpot_error: dict[str, float] = {}  # the same for TPOT
        # running mean of log(measured / predicted slot wait), over every replica: what the
        # output lengths ahead of a queued request miss is the workload's, not a replica's
        self._log_wait_error = 0.0
        self._caching: set[str] = set()  # replicas whose reports carry K/V events: a prefix cache
        self._priced: set[str] = set()  # replicas whose reports have carried their own pricing
        self._last: dict[str, tuple[Prediction, int]] = {}  # the last scoring's raw predictions, cached tokens
        self.residuals = OutputResiduals()

    def scores(
        self, request: RouteRequest, views: list[ReplicaView], matched: dict[str, int], expected_output: float
    ) -> list[float]:
        """Per replica, the predicted TTFT if its predicted TPOT meets the SLO, else +inf (no
        replica meets it: every one's TTFT). `matched`: the prompt's leading blocks each holds."""
        self._last = {}
        for v in views:
            cached = 0
            if v.replica_id in self._caching:  # a replica without a prefix cache hits nothing
                cached = min(request.prompt_len - 1, matched.get(v.replica_id, 0) * request.block_size)
            self._last[v.replica_id] = (self.predict_raw(request, v, cached, expected_output), cached)
        predicted = [self.corrected(v.replica_id, self._last[v.replica_id][0]) for v in views]
        eligible = [p.tpot <= self.tpot_slo for p in predicted]
        if not any(eligible):
            eligible = [True] * len(views)
        return [p.ttft if ok else math.inf for p, ok in zip(predicted, eligible)]

    def correction(self, replica_id: str) -> float:
        """What this replica's raw TTFT is multiplied by (1 until it has reported a TTFT)."""
        return math.exp(self._log_error.get(replica_id, 0.0))

    def tpot_correction(self, replica_id: str) -> float:
        """What this replica's raw TPOT is multiplied by: its TTFT correction until its reports
        have shown a request's decode."""
        log_error = self._log_tpot_error.get(replica_id)
        return self.correction(replica_id) if log_error is None else math.exp(log_error)

    def wait_correction(self) -> float:
        """What a raw slot wait is multiplied by (1 until a queued request has shown one)."""
        return math.exp(self._log_wait_error)

    def corrected(self, replica_id: str, raw: Prediction) -> Prediction:
        wait = raw.slot_wait * self.wait_correction()
        ttft = (raw.ttft - raw.slot_wait) * self.correction(replica_id) + wait
        return Prediction(ttft, raw.tpot * self.tpot_correction(replica_id), wait)

    def predict_raw(
        self, request: RouteRequest, view: ReplicaView, cached: int = 0, expected_output: float = 1.0
    ) -> Prediction:
        """TTFT and TPOT of `request` on the replica by its pricing alone (see the module
        docstring), from now; `cached`: prompt tokens its prefix cache holds."""
        report = view.report
        pricing = report.pricing if report is not None and report.pricing is not None else DEFAULT_PRICING
        slots = report.num_slots if report is not None else defaults.NUM_SLOTS
        kv_tokens = report.kv_capacity_tokens if report is not None else 0
        age = view.report_age or 0.0
        new = _Row(request.prompt_len - cached, cached, max(1.0, expected_output), cached, ready=age)
        return _walk(pricing, slots, kv_tokens, self._rows(view), new)

    def _rows(self, view: ReplicaView) -> list[_Row]:
        """The replica's requests in flight, in dispatch order, as far as its last report says."""
        report = view.report
        rows, decoding = [], []
        for request_id, placed in self._by_replica.get(view.replica_id, {}).items():
            expected = max(1.0, placed.expected_output)
            made = 0 if report is None or placed.dispatched > report.time else report.tokens_made.get(request_id)
            if made is None and placed.reported:
                continue  # ended before the report (its completion is on its way)
            made = made or 0  # None: not there yet (on its way, or in its inbox while a step ran)
            if made == 0:  # queued; one sent after the report was taken cannot start before it arrived
                ready = 0.0 if report is None else max(0.0, placed.dispatched - report.time)
                rows.append(_Row(placed.to_prefill, placed.cached, expected, placed.cached, ready))
            else:
                rows.append(_Row(0.0, placed.prompt_len + made, 0.0, placed.cached))
                decoding.append((rows[-1], expected, made))
        ahead = self.residuals.remaining([(expected, made) for _, expected, made in decoding])
        for (row, _, _), left in zip(decoding, ahead):
            row.decode_left = left
        return rows

    def dispatched(self, request: RouteRequest, replica_id: str, now: float, expected_output: float) -> None:
        """The request went to `replica_id` after `scores`: it joins that replica's queue."""
        raw, cached = self._last.get(replica_id, (None, 0))
        self.completed(request.request_id)  # a moved request leaves its old queue
        placed = _Placed(
            replica_id,
            now,
            request.prompt_len,
            request.prompt_len - cached,
            cached,
            expected_output,
            math.nan if raw is None else raw.ttft,
            math.nan if raw is None else raw.tpot,
            0.0 if raw is None else raw.slot_wait,
            request.waited(now),
        )
        self._placed[request.request_id] = placed
        self._by_replica.setdefault(replica_id, {})[request.request_id] = placed

    def completed(self, request_id: str, output_len: int | None = None) -> None:
        """The request left its replica (`output_len`: what it made on a natural end, None: not
        known or moved), so it leaves that queue and its length joins the residuals'."""
        if output_len is not None:
            self.residuals.observe(output_len)
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            del self._by_replica[placed.replica_id][request_id]

    def reported(self, load: LoadReport) -> None:
        """Learn the replica's errors from the TTFTs and the decode its report shows, once per
        request each."""
        if load.kv_events is not None:
            self._caching.add(load.replica_id)
        if load.pricing is not None and load.replica_id not in self._priced:
            # its first prices of its own (a real replica's measured ones): what was learned
            # against the fallback's would mis-scale them
            self._priced.add(load.replica_id)
            self._log_error.pop(load.replica_id, None)
            self._log_tpot_error.pop(load.replica_id, None)
        held = self._by_replica.get(load.replica_id)
        if not held:
            return
        for request_id, measured in load.ttft.items():
            placed = held.get(request_id)
            if placed is None or not placed.predicted_ttft > 0 or measured <= 0:
                continue  # not placed here, already learned from, or a moved request's carried tokens
            since_dispatch = max(measured - placed.waited, 1e-9)
            wait = placed.predicted_wait
            if wait <= 0:
                _learn(self._log_error, load.replica_id, since_dispatch / placed.predicted_ttft, 0.0)
            else:  # its own prefill as the replica's correction prices it; the rest was its wait
                own = (placed.predicted_ttft - wait) * self.correction(load.replica_id)
                self._log_wait_error = _learned(self._log_wait_error, max(since_dispatch - own, 1e-9) / wait)
            placed.predicted_ttft = math.nan  # one sample per request
        for request_id, made in load.tokens_made.items():
            placed = held.get(request_id)
            if placed is not None:
                placed.reported = True
            if placed is None or made < 1 or not 0 < placed.predicted_tpot < math.inf or placed.dispatched > load.time:
                continue  # not placed here, no token yet, already learned from, or predicted to make none
            if placed.decode_seen is None:
                placed.decode_seen = (load.time, made)
                continue
            since, made_then = placed.decode_seen
            if made - made_then >= TPOT_STEPS:
                measured = (load.time - since) / (made - made_then)
                prior = self._log_error.get(load.replica_id, 0.0)  # what stood in for it
                _learn(self._log_tpot_error, load.replica_id, measured / placed.predicted_tpot, prior)
                placed.predicted_tpot = math.nan

    def predicted_ttft(self, replica_id: str) -> float | None:
        """The last scoring's corrected TTFT for the replica (what a decision records)."""
        last = self._last.get(replica_id)
        return None if last is None else self.corrected(replica_id, last[0]).ttft


def _learn(log_errors: dict[str, float], replica_id: str, ratio: float, prior: float) -> None:
    """One error sample into the replica's running mean of log errors, which starts from `prior`."""
    log_errors[replica_id] = _learned(log_errors.get(replica_id, prior), ratio)


def _learned(log_error: float, ratio: float) -> float:
    """A running mean of log errors after one more sample (measured / predicted, clipped)."""
    ratio = min(MAX_ERROR_RATIO, max(1 / MAX_ERROR_RATIO, ratio))
    return log_error + CORRECTION_WEIGHT * (math.log(ratio) - log_error)


def _admitted(queue: list[_Row], slots: int, kv_tokens: int) -> list[_Row]:
    """The rows that hold slots: the first in order, at most `slots`, and while their K/V fits
    `kv_tokens` (0: no bound) once their prompts are in, as a paged replica admits (always the
    first). Their cached prefixes are taken as one shared prefix, held once: requests routed to
    a replica for its cache mostly share the one it held."""
    if not kv_tokens:
        return queue[:slots]
    running: list[_Row] = []
    own = shared = 0.0
    for row in queue[:slots]:
        need_own = own + (row.context - row.shared + row.prefill_left)  # its `kv_need`, inlined
        need_shared = row.shared if row.shared > shared else shared
        if running and need_own + need_shared > kv_tokens:
            break
        running.append(row)
        own, shared = need_own, need_shared
    return running


def _kv_steps(running: list[_Row], kv_tokens: int) -> float:
    """Steps of decode alone (each row's K/V one token longer a step) that `running` stays the
    rows `_admitted` takes: its checks, with every running row's need `j` tokens longer at the
    j-th step, pass while `j` is at most the slack over the rows up to each, shared out."""
    if not kv_tokens:
        return math.inf
    steps, own, shared = math.inf, 0.0, 0.0
    for i, row in enumerate(running):
        own += row.context - row.shared + row.prefill_left
        shared = row.shared if row.shared > shared else shared
        if i:
            steps = min(steps, (kv_tokens - (own + shared)) // (i + 1) + 1)
    return steps


def _walk(pricing: StepPricing, slots: int, kv_tokens: int, rows: list[_Row], new: _Row) -> Prediction:
    """Step the queue `rows` with `new` behind them until `new` has made its first token and
    `TPOT_STEPS` more (or its expected output): its TTFT and mean time per output token after the
    first. The walk starts at the report, `new.ready` seconds ago (now). Each row joins the first
    step that starts once it has reached the replica (its `ready`; `new` waits out the step in
    progress), and a replica with nothing to run waits for the next to reach it: a request sent
    after an idle report cannot have been running since. A row runs once it holds a slot and its
    K/V fits the replica's `kv_tokens` (`_admitted`).

    Steps that only decode, with no row arriving, ending or losing its K/V room, are run as one
    stretch: their times are added one by one, as a step at a time would (the same sums in the
    same order), and the rows' counts moved once at its end. `new` is always the last row of
    the queue once it has joined (rows join in dispatch order; it is the last sent), so it runs
    when the last running row is it."""
    cost, budget = pricing.cost, pricing.token_budget
    c0, c_decode, c_prefill, c_ctx = cost.c0, cost.c_decode, cost.c_prefill, cost.c_ctx
    overhead = pricing.loop_overhead
    age = new.ready
    coming = deque([*(_Row(r.prefill_left, r.context, r.decode_left, r.shared, r.ready) for r in rows), new])
    full = new not in _admitted(list(coming), slots, kv_tokens)  # as reported, no room for it
    queue: list[_Row] = []
    elapsed, first_token, decoded = 0.0, None, 0
    joined = slotted = None
    in_queue = False  # whether `new` is in the queue
    done = False
    it = 0
    while it < MAX_WALK_STEPS:
        it += 1
        if not queue:
            elapsed = max(elapsed, coming[0].ready)
        while coming and coming[0].ready <= elapsed:
            queue.append(coming.popleft())
            if queue[-1] is new:
                joined, in_queue = elapsed, True
        running = queue[:slots] if not kv_tokens else _admitted(queue, slots, kv_tokens)
        new_runs = bool(running) and running[-1] is new
        if slotted is None and new_runs:
            slotted = elapsed
        decodes = [r for r in running if r.prefill_left <= 0]
        least = min((r.decode_left for r in running), default=0.0)
        if len(decodes) == len(running) and least > 0:
            # decode alone: a stretch of steps while no row ends, arrives or loses its K/V room
            span = MAX_WALK_STEPS - it + 1  # steps left within the walk's bound
            if least < span:
                span = math.ceil(least)  # the step after which the first row has made its output
            span = min(span, _kv_steps(running, kv_tokens))
            count = len(running)
            context = sum(r.context + 1 for r in running)
            fixed = c0 + c_decode * count + c_prefill * 0  # a step's price but its context, evaluated as a step's
            arrives = coming[0].ready if coming else math.inf  # when the next row could join
            j = 0
            if not (new.prefill_left <= 0 and in_queue):  # `new` makes no token over the stretch
                while True:
                    elapsed += fixed + c_ctx * context
                    j += 1
                    elapsed += overhead
                    if j >= span or (coming and arrives <= elapsed):
                        break
                    context += count
            else:
                new_left = new.decode_left
                while True:
                    elapsed += fixed + c_ctx * context
                    j += 1
                    if first_token is None:
                        first_token = elapsed
                    else:
                        decoded += 1
                    if decoded >= TPOT_STEPS or (new_left - j if new_runs else new_left) <= 0:
                        done = True
                        break
                    elapsed += overhead
                    if j >= span or (coming and arrives <= elapsed):
                        break
                    context += count
            it += j - 1
            for row in running:
                row.context += j
                row.decode_left -= j
            if done:
                break
        else:
            left = math.inf if budget is None else float(budget - len(decodes))
            context = sum(r.context + 1 for r in decodes)
            chunks = []
            for row in running:
                if row.prefill_left > 0 and left > 0:
                    n = min(row.prefill_left, left)
                    context += n * row.context + n * (n + 1) / 2
                    left -= n
                    chunks.append((row, n))
            prefill = sum(n for _, n in chunks)
            elapsed += c0 + c_decode * len(decodes) + c_prefill * prefill + c_ctx * context
            for row in decodes:
                row.context += 1
                row.decode_left -= 1
            for row, n in chunks:
                row.prefill_left -= n
                row.context += n
                if row.prefill_left <= 0:
                    row.decode_left -= 1  # the step that ends a prefill samples the first token
            if new.prefill_left <= 0 and in_queue:
                if first_token is None:
                    first_token = elapsed
                else:
                    decoded += 1
                if decoded >= TPOT_STEPS or new.decode_left <= 0:
                    break
            elapsed += overhead  # the serving loop's own work before the next step
        queue = [r for r in queue if r.decode_left > 0]
        if in_queue and not new.decode_left > 0:
            in_queue = False
    # on a replica whose slots (or K/V) were all held, the wait for one counts from now (its end is a
    # guess at the lengths ahead), even when a slot is predicted to free as it joins
    if joined is None:  # the walk's bound came before the report's age: it never joined
        return Prediction(elapsed, math.inf)
    wait = (elapsed if slotted is None else slotted) - (age if full else joined)
    if first_token is None:
        return Prediction(elapsed, math.inf, wait)
    tpot = (elapsed - first_token) / decoded if decoded else 0.0
    return Prediction(first_token - age, tpot, wait)
