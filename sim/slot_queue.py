"""A coarser model of an autoscaled cluster, for days of traffic on hundreds of replicas: each
replica a first-come-first-served queue in front of its slots, each request priced once, when it
takes a slot, where `sim.autoscaling` steps every replica's engine.

Why: the step simulator pays a Python engine step per replica step, a few per replica-second,
so a day on 256 replicas is tens of millions of them. Here the work is a constant per request
plus one load report per serving replica per decision, and what autoscaling turns on is kept:

- the waits of a work-conserving queue with S slots (a request takes the slot that frees
  first, after the requests routed there before it: the Kiefer-Wolfowitz recursion);
- least-loaded routing, exact: the serving replica with the fewest ongoing requests (the one
  longest at that count on a tie), which is what `least_loaded`'s score ranks for replicas of
  one size;
- the same autoscaling policy objects, observations and bounds as the step simulator, with its
  cold starts (a replica takes traffic `cold_start_s` after it was asked for), its scale-down
  order (starting ones cancelled newest first, then the serving ones holding fewest requests
  drained) and its replica-seconds (asked for to last request finished).

The price of a request that takes a slot with n slots then busy (itself included) is the mean
step of a replica with n busy slots, held for its whole stay:

    T(n) = step_overhead + c0 + n * (c_decode + c_prefill * P / O + c_ctx * C)

where each busy slot makes a token a step and brings in a new prompt every O steps (P and O:
the workload's mean prompt and output lengths, so P / O prompt tokens a slot a step) attending
C tokens of context on average (a request's context over its decode steps, weighted by them).
Its first token comes ceil(prompt / token_budget) steps of T(n) after it takes the slot, plus
its own prompt's c_prefill per token in them, plus half a step where others were busy (the step
under way ends first), plus the `dispatch_delay` before it reaches the replica; its TPOT is
T(n). What it does not see: the occupancy changing under a running request and the order of
the work within a step, so its TTFTs' tail is thinner than the engines'. How far that moves
replica-seconds, SLO attainment and TTFT from the step simulator on the same traffic is what
`benchmarks/autoscaling_scale.py --check` measures."""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass

import numpy as np

from autoscaling.policies import AutoscaleConfig, make_autoscaling_policy
from metrics.definitions import SLO
from protocol import defaults
from protocol.clock import FakeClock
from protocol.cost import LinearCostModel
from protocol.messages import LoadReport
from protocol.scaling import ArrivalWindow, ScalingDecision, ScalingObservation
from replica.errors import ConfigError
from sim.autoscaling import ReplicaSpan, ScalingRecord
from sim.simulator import SimulationConfig, _advance
from workloads.capacity import Capacity
from workloads.workload import WorkloadColumns

# Batching policies whose steps this model's price stands for: every busy slot decodes each step
# and prompts join running batches (static and dynamic batches wait for each other instead).
CONTINUOUS_POLICIES = ("continuous", "chunked", "mixed")


@dataclass
class SlotQueueResult(ScalingRecord):
    """The scaling record and, per request in arrival order, its replica (-1: refused: longer
    than `max_seq_len`, or the router's bound reached on every serving replica, as the router
    refuses), TTFT and TPOT (NaN where refused or with one output token)."""

    replica: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray

    def slo_attainment(self, slo: SLO) -> float:
        """The share of requests served within `slo` (as `SLO.met_by` judges a trace)."""
        if slo.e2e is not None:
            raise ConfigError("the slot-queue model keeps no end-to-end latency: judge by TTFT and TPOT")
        met = (self.replica >= 0) & (self.ttft <= slo.ttft) & ~(self.tpot > slo.tpot)
        return float(met.mean()) if met.size else 0.0


class SlotQueueCluster:
    """`SlotQueueCluster(requests, config, autoscale, cost, capacity).run()`: the traffic through
    `config.num_replicas` replicas at first, grown and shrunk by `autoscale`'s policy."""

    def __init__(
        self,
        requests: WorkloadColumns,
        config: SimulationConfig,
        autoscale: AutoscaleConfig,
        cost: LinearCostModel,
        capacity: Capacity | None = None,
        cold_start_s: float = 10.0,
    ):
        if config.engine.policy not in CONTINUOUS_POLICIES:
            raise ConfigError(
                f"the slot-queue model prices continuous batching ({', '.join(CONTINUOUS_POLICIES)}), "
                f"not {config.engine.policy!r}: use sim.autoscaling.AutoscalingSimulator"
            )
        if config.routing_policy != "least_loaded" or config.cost_scales is not None or config.routers != 1:
            raise ConfigError(
                "the slot-queue model routes least_loaded, by one router, over replicas of one speed only"
            )
        if not autoscale.min_replicas <= config.num_replicas <= autoscale.max_replicas:
            raise ConfigError(
                f"num_replicas {config.num_replicas} must lie within the autoscaling bounds "
                f"[{autoscale.min_replicas}, {autoscale.max_replicas}]"
            )
        if len(requests) == 0:
            raise ConfigError("no requests to run")
        self.requests = requests
        self.config = config
        self.autoscale = autoscale
        self.cold_start_s = cold_start_s
        self.clock = FakeClock()
        self.policy = make_autoscaling_policy(autoscale, self.clock, capacity)
        self.cost = cost
        self.step_price = step_prices(requests, config, cost)

    def run(self) -> SlotQueueResult:
        return _Run(self).result()


def step_prices(requests: WorkloadColumns, config: SimulationConfig, cost: LinearCostModel) -> list[float]:
    """T(n) for n = 0..num_slots busy slots (see the module docstring)."""
    prompt = requests.prompt_len.astype(float)
    output = requests.output_len.astype(float)
    decode = np.maximum(output - 1, 1)
    per_token = cost.c_prefill * prompt.mean() / output.mean()
    context = float((decode * (prompt + decode / 2)).sum() / decode.sum())
    per_slot = cost.c_decode + per_token + cost.c_ctx * context
    fixed = config.step_overhead + cost.c0
    return [fixed + n * per_slot for n in range(config.engine.num_slots + 1)]


class _Run:
    """One pass over the arrivals; replicas are indices in the order they were asked for."""

    def __init__(self, cluster: SlotQueueCluster):
        self.c = cluster
        self.slots_per_replica = cluster.config.engine.num_slots
        self.spans: list[ReplicaSpan] = []
        self.slots: list[list[float]] = []  # per replica: when each slot's last request finishes
        self.ongoing: list[int] = []
        self.by_count: list[dict[int, None]] = [{}]  # serving replicas by ongoing count (ordered sets)
        self.fewest = 0  # the lowest count with a serving replica at it
        self.done: list[tuple[float, int]] = []  # (finish, replica) of the requests in flight
        self.starting: list[int] = []
        self.draining: dict[int, float] = {}  # replica -> when its last request finishes
        self.decisions: list[ScalingDecision] = []
        self.window = [0.0, 0, 0, 0]  # start, requests, prompt tokens, output tokens since the last decision
        self.measured_cold_start = False
        first = float(cluster.requests.arrival[0])
        for _ in range(cluster.config.num_replicas):
            self._attach(self._new_replica(first), first)

    # ---- replicas ------------------------------------------------------------------------
    def _new_replica(self, requested: float) -> int:
        index = len(self.spans)
        self.spans.append(ReplicaSpan(f"r{index}", requested))
        self.slots.append([])
        self.ongoing.append(0)
        return index

    def _attach(self, index: int, now: float) -> None:
        self.spans[index].ready = now
        self.slots[index] = [now] * self.slots_per_replica
        self.by_count[0][index] = None
        self.fewest = 0

    def _move(self, index: int, count: int, by: int) -> None:
        """Replica `index` (serving) goes from `count` ongoing requests to `count + by`."""
        del self.by_count[count][index]
        if count + by == len(self.by_count):
            self.by_count.append({})
        self.by_count[count + by][index] = None
        if by < 0:
            self.fewest = min(self.fewest, count + by)
        else:
            self._raise_fewest()

    def _raise_fewest(self) -> None:
        """Past the counts no serving replica is at (the last count if none serves)."""
        while self.fewest < len(self.by_count) - 1 and not self.by_count[self.fewest]:
            self.fewest += 1

    def _finish_until(self, now: float) -> None:
        done, ongoing = self.done, self.ongoing
        while done and done[0][0] <= now:
            _, index = heapq.heappop(done)
            count = ongoing[index]
            ongoing[index] = count - 1
            if index not in self.draining:
                self._move(index, count, -1)

    # ---- decisions -----------------------------------------------------------------------
    def _decide(self, now: float) -> None:
        self._finish_until(now)
        while self.starting and self.spans[self.starting[0]].requested + self.c.cold_start_s <= now:
            self._attach(self.starting.pop(0), now)
            self.measured_cold_start = True
        for index, end in list(self.draining.items()):
            if end <= now:
                self.spans[index].ended = end
                del self.draining[index]
        _advance(self.c.clock, now)
        decision = self.c.policy.decide(self._observe(now))
        self.decisions.append(decision)
        if decision.change > 0:
            for _ in range(decision.change):
                self.starting.append(self._new_replica(now))
        elif decision.change < 0:
            self._shrink(-decision.change, now)

    def _observe(self, now: float) -> ScalingObservation:
        s, max_seq = self.slots_per_replica, self.c.config.engine.max_seq_len
        reports = []
        for count, replicas in enumerate(self.by_count):
            running = min(count, s)
            free = s - running
            for index in replicas:
                rid = self.spans[index].replica_id
                reports.append(LoadReport(rid, count - running, running, free, s, free * max_seq, now))
        start, requests, prompt, output = self.window
        self.window[:] = [now, 0, 0, 0]
        cold = self.c.cold_start_s if self.measured_cold_start else 0.0
        arrivals = ArrivalWindow(start, now, requests, prompt, output)
        return ScalingObservation(len(reports), tuple(reports), arrivals, len(self.starting), len(self.draining), cold)

    def _shrink(self, count: int, now: float) -> None:
        while count and self.starting:
            self.spans[self.starting.pop()].ended = now
            count -= 1
        serving = sorted((i for replicas in self.by_count for i in replicas), key=lambda i: (self.ongoing[i], -i))
        for index in serving[:count]:
            del self.by_count[self.ongoing[index]][index]
            self.draining[index] = max(now, max(self.slots[index]))
            self.spans[index].drain_started = now
        self._raise_fewest()

    # ---- the arrivals --------------------------------------------------------------------
    def result(self) -> SlotQueueResult:
        c = self.c
        engine = c.config.engine
        budget = engine.token_budget if engine.policy == "chunked" else 0  # the others prefill a prompt whole
        price, delay, max_seq = c.step_price, c.config.dispatch_delay, engine.max_seq_len
        own = c.cost.c_prefill  # a prompt's own tokens in the steps that prefill it, past the mean share T(n) holds
        period = c.autoscale.period_s
        next_decision = period  # on the step simulator's grid
        replica_of, ttfts, tpots = array("l"), array("d"), array("d")
        slots, ongoing, done, window = self.slots, self.ongoing, self.done, self.window
        nan, bound = math.nan, defaults.MAX_IN_FLIGHT_PER_REPLICA  # the router's: past it on every replica, refused
        for t, prompt, output in zip(
            c.requests.arrival.tolist(), c.requests.prompt_len.tolist(), c.requests.output_len.tolist()
        ):
            while t >= next_decision:
                self._decide(next_decision)
                next_decision += period
            window[1] += 1
            window[2] += prompt
            window[3] += output
            self._finish_until(t)
            if prompt + output > max_seq or not self.by_count[self.fewest] or self.fewest >= bound:
                replica_of.append(-1)
                ttfts.append(nan)
                tpots.append(nan)
                continue
            index = next(iter(self.by_count[self.fewest]))
            count = ongoing[index]
            self._move(index, count, 1)
            ongoing[index] = count + 1
            free = slots[index]
            start = max(t + delay, heapq.heappop(free))
            busy = 1 + sum(1 for f in free if f > start)
            step = price[busy]
            align = step / 2 if busy > 1 else 0.0  # a busy replica finishes the step it is in first
            first = start + align + (-(-prompt // budget) if budget else 1) * step + own * prompt
            finish = first + (output - 1) * step
            heapq.heappush(free, finish)
            heapq.heappush(done, (finish, index))
            replica_of.append(index)
            ttfts.append(first - t)
            tpots.append(step if output > 1 else nan)
        end = max([float(c.requests.arrival[-1]), *(max(s) for s in slots if s)])
        for index, finished in self.draining.items():  # drains end as their last requests do
            self.spans[index].ended = finished
        for span in self.spans:
            if span.ended is None:
                span.ended = end
        return SlotQueueResult(
            c.autoscale,
            c.cold_start_s,
            self.decisions,
            self.spans,
            end,
            np.frombuffer(replica_of, dtype=np.int64),
            np.frombuffer(ttfts),
            np.frombuffer(tpots),
        )
