# Over 400 lines: every routing policy beside the base class it overrides and the one registry of
# them all (each policy is a small override; the models they score by live in their own modules).
"""The routing policies compared by slotserve. Each scores every replica (lower is better)
from the router's load view and the base class picks the lowest, so a decision can be logged
with all its scores and two policies differ in their scoring and nothing else.

Ties go to the first tied replica at or after a cursor that moves past every choice, so equal
replicas take turns rather than the first one filling up; the order is deterministic.

Policies are pure: no Ray, no clock of their own (report ages come in the views), randomness
from a seeded `random.Random`. A policy that keeps state about requests (reserved work, an
output-length estimate, a prefix index) hears of each dispatch and completion through
`dispatched` and `completed`, which the router calls.

A policy that needs no more than the least loaded replica, or a few replicas' load scores, is
`indexed`: it chooses from the router's index of routable replicas (`router.load.RoutableIndex`)
in O(log n) instead of scoring every view, with the same choice and tie-break.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from protocol import defaults
from protocol.messages import LoadReport
from protocol.registry import Registry
from protocol.routing import RouteRequest
from router.block_index import BlockIndex, InFlightBlocks
from router.length_predictor import BucketedLength, MeanLength
from router.load import ReplicaView, RoutableIndex
from router.predicted_latency import LatencyModel
from router.prefix_index import CAPACITY_BLOCKS, PrefixIndex
from router.work import DECODE_WEIGHT, WorkLedger


class RoutingPolicy:
    name: str = ""
    uses_load = True  # whether decisions depend on load reports (else their signal age is None)
    uses_tpot_slo = False  # whether it routes within the run's TPOT SLO (then made with `tpot_slo`)
    indexed = False  # whether it chooses from the routable index (`choose_indexed`), not from every view

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self._cursor = 0

    def choose(self, request: RouteRequest, views: list[ReplicaView]) -> tuple[int, list[float]]:
        """Index of the chosen replica in `views`, and one score per replica."""
        scores = self.scores(request, views)
        return self._pick(scores), scores

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        raise NotImplementedError

    def choose_indexed(self, request: RouteRequest, routable: RoutableIndex) -> tuple[int, dict[int, float]]:
        """`choose` from the index (an `indexed` policy): the rank of the chosen replica (its
        index in the routable views `choose` would be given), and the scores it looked at, by
        rank. Makes the choice `choose` would make, with the same cursor and random draws."""
        raise NotImplementedError

    def indexed_scores(
        self, views: list[ReplicaView], looked: dict[int, float], routable: RoutableIndex
    ) -> list[float]:
        """Every routable replica's score for a decision `choose_indexed` made (`looked`: the
        scores it looked at), as `scores` would have given them: here, +inf for the others."""
        return [looked.get(i, math.inf) for i in range(len(views))]

    def dispatched(self, request: RouteRequest, replica_id: str, now: float) -> None:
        """The router sent `request` to `replica_id` (after `choose`)."""

    def completed(self, request_id: str, output_len: int | None) -> None:
        """The request ended, having made `output_len` tokens (None: not known)."""

    def attach_block_index(self, index: BlockIndex) -> None:
        """The router's precise block index (kept from the replicas' K/V events); a policy
        that scores by it keeps it."""

    def reported(self, load: LoadReport) -> None:
        """A replica's load report reached the router (a policy that learns from them hears it)."""

    def predicted_ttft(self, replica_id: str) -> float | None:
        """The TTFT this policy predicted for the request it last scored on the replica (the
        router logs it for the chosen one); None: it predicts none."""
        return None

    def believed_cached(self, request: RouteRequest, replica_id: str) -> int | None:
        """Prompt tokens this policy took to be in the replica's prefix cache when it last scored
        `request` (the router logs it for the chosen replica, and the replica's count of the
        tokens that did hit at admission measures how stale that belief was); None: it does not
        look at caches."""
        return None

    def _pick(self, scores: list[float]) -> int:
        best = min(scores)
        n = len(scores)
        index = next(i for i in ((self._cursor + k) % n for k in range(n)) if scores[i] == best)
        self._cursor = (index + 1) % n
        return index

    def _pick_looked(self, looked: dict[int, float], n: int) -> int:
        """`_pick` over `n` scores of which only `looked` (by index) are finite."""
        best = min(looked.values())
        cursor = self._cursor
        index = min((i for i, s in looked.items() if s == best), key=lambda i: (i - cursor) % n)
        self._cursor = (index + 1) % n
        return index


class RoundRobin(RoutingPolicy):
    """Each replica in turn, load ignored. Score: position in the rotation (0 is next)."""

    name = "round_robin"
    uses_load = False

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        return [float((i - self._cursor) % len(views)) for i in range(len(views))]


class RandomChoice(RoutingPolicy):
    """Uniformly at random, load ignored. Score: the random draw."""

    name = "random"
    uses_load = False

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        return [self.rng.random() for _ in views]


class LeastQueue(RoutingPolicy):
    """Shortest estimated queue (reported queue plus in-flight requests that found no free
    slot); free slots beyond an empty queue do not count."""

    name = "least_queue"

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        return [float(v.est_queue) for v in views]


class MostFreeSlots(RoutingPolicy):
    """Most estimated free slots (reported free slots less in-flight requests not yet seen)."""

    name = "most_free_slots"

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        return [-float(v.est_free_slots) for v in views]


class LeastLoaded(RoutingPolicy):
    """The default: queue depth and free slots together, as `ReplicaView.load_score` =
    estimated queue - estimated free slots (how far a new request would be from a slot).
    Running requests add nothing apart: on replicas of one size running = slots - free, so
    counting them too would not change the ranking."""

    name = "least_loaded"
    indexed = True

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        return [v.load_score for v in views]

    def choose_indexed(self, request: RouteRequest, routable: RoutableIndex) -> tuple[int, dict[int, float]]:
        n = len(routable)
        index = routable.least_loaded(self._cursor % n)
        self._cursor = (index + 1) % n
        return index, {index: routable.score_at(index)}

    def indexed_scores(
        self, views: list[ReplicaView], looked: dict[int, float], routable: RoutableIndex
    ) -> list[float]:
        """Every view's `load_score`, as the index holds them."""
        return list(routable.ordered_scores())


class PowerOfTwo(RoutingPolicy):
    """Two replicas sampled at random, the less loaded of them taken (as Ray Serve does): it
    needs a fresh look at only two replicas. Unsampled replicas score +inf."""

    name = "power_of_two"
    indexed = True

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        sampled = set(self.rng.sample(range(len(views)), min(2, len(views))))
        return [v.load_score if i in sampled else math.inf for i, v in enumerate(views)]

    def choose_indexed(self, request: RouteRequest, routable: RoutableIndex) -> tuple[int, dict[int, float]]:
        n = len(routable)
        looked = {i: routable.score_at(i) for i in self.rng.sample(range(n), min(2, n))}
        return self._pick_looked(looked, n), looked


class SessionAffinity(RoutingPolicy):
    """Requests of one session go to the replica its last request went to (warm prefix cache,
    ordered turns) while that replica is not overloaded: its load score exceeds the least
    loaded replica's by more than `overload_margin` requests. Otherwise, and for requests
    without a session, least loaded; the session then sticks to the new replica. The
    session table keeps the `max_sessions` most recently used sessions."""

    name = "session_affinity"

    def __init__(self, seed: int = 0, overload_margin: float = 4.0, max_sessions: int = 100_000):
        super().__init__(seed)
        self.overload_margin = overload_margin
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> replica id

    def choose(self, request: RouteRequest, views: list[ReplicaView]) -> tuple[int, list[float]]:
        scores = [v.load_score for v in views]
        session = request.session_id
        if session is None:
            return self._pick(scores), scores
        sticky = self._sessions.get(session)
        index = next((i for i, v in enumerate(views) if v.replica_id == sticky), None)
        if index is None or scores[index] > min(scores) + self.overload_margin:
            index = self._pick(scores)
        self._sessions[session] = views[index].replica_id
        self._sessions.move_to_end(session)
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return index, scores


class LeastWork(RoutingPolicy):
    """Least pending work in tokens (`router.work.WorkLedger.score`): prompt tokens still to
    prefill plus the expected decode tokens left, reserved at dispatch and released as the
    replica reports tokens made, plus the decode steps until a slot frees when all are taken.
    The expected output is the running mean of finished requests' outputs."""

    name = "least_work"
    predictor = MeanLength

    def __init__(self, seed: int = 0, decode_weight: float = DECODE_WEIGHT):
        super().__init__(seed)
        self.work = WorkLedger(decode_weight)
        self.lengths = self.predictor()
        self._in_flight: dict[str, RouteRequest] = {}

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        return self.work.scores(views)

    def dispatched(self, request: RouteRequest, replica_id: str, now: float) -> None:
        prefill = self.prefill_tokens(request, replica_id)
        self.work.reserve(request.request_id, replica_id, prefill, self.lengths.estimate(request), now)
        self._in_flight[request.request_id] = request

    def prefill_tokens(self, request: RouteRequest, replica_id: str) -> int:
        """Prompt tokens the replica will compute for the request: here, all of them."""
        return request.prompt_len

    def completed(self, request_id: str, output_len: int | None) -> None:
        self.work.release(request_id)
        request = self._in_flight.pop(request_id, None)
        if request is not None and output_len is not None:
            self.lengths.observe(request, output_len)


class PredictedLength(LeastWork):
    """`least_work` with a per-request output-length estimate: the session's last output, else
    the recent median for prompts of similar length (`router.length_predictor.BucketedLength`)."""

    name = "predicted_length"
    predictor = BucketedLength


class PrefixAffinity(PredictedLength):
    """Where the prompt's prefix is cached, unless that replica is too busy. Score: the cost of
    serving the request there, in prefill-token equivalents, as Dynamo's KV router prices it:
    prompt tokens not found in the replica's cache (by the approximate `PrefixIndex`) plus the
    replica's pending work (`predicted_length`'s estimate, in which a routed request reserves
    only the prompt tokens its replica was not found to hold: a hit's prefix is not work).

    Imbalance guard (after SGLang's cache-aware router): a replica whose pending work exceeds
    `balance_ratio` x the least pending work plus `balance_tokens` is not eligible (+inf), so a
    popular prefix cannot pile requests onto one replica; its requests spill to the next
    cheapest, which then caches the prefix too. Requests without block hashes are placed by
    pending work alone. `miss_weight` prices a prompt token to compute above a token of pending
    work: pending work is done wherever the request goes, a miss is work the cluster adds (and
    its blocks evict someone else's prefix)."""

    name = "prefix_affinity"

    def __init__(
        self,
        seed: int = 0,
        decode_weight: float = DECODE_WEIGHT,
        balance_ratio: float = 1.5,
        balance_tokens: float = 1024.0,
        capacity_blocks: int = CAPACITY_BLOCKS,
        miss_weight: float = 1.0,
    ):
        super().__init__(seed, decode_weight)
        self.balance_ratio, self.balance_tokens = balance_ratio, balance_tokens
        self.miss_weight = miss_weight
        self.index = PrefixIndex(capacity_blocks)
        self._matched: tuple[str, dict[str, int]] = ("", {})  # request id, its blocks matched per replica

    def matched(self, request: RouteRequest, views: list[ReplicaView]) -> dict[str, int]:
        """How many of the prompt's leading blocks each replica holds, as this policy knows it
        (`cached_blocks`); kept for the dispatch that follows (`matched_blocks`)."""
        matched = self.cached_blocks(request, views)
        self._matched = (request.request_id, matched)
        return matched

    def cached_blocks(self, request: RouteRequest, views: list[ReplicaView]) -> dict[str, int]:
        """Here, by the approximate index of past dispatches."""
        return self.index.matched_blocks(request.block_hashes, [v.replica_id for v in views])

    def remember(self, request: RouteRequest, replica_id: str) -> None:
        """What the index learns from a dispatch: here, that the replica will hold the prompt."""
        self.index.insert(replica_id, request.block_hashes)

    def matched_blocks(self, request: RouteRequest, replica_id: str) -> int:
        """Leading prompt blocks the last scoring of `request` found on the replica."""
        request_id, matched = self._matched
        return matched.get(replica_id, 0) if request_id == request.request_id else 0

    def believed_cached(self, request: RouteRequest, replica_id: str) -> int | None:
        cacheable = max(0, (request.prompt_len - 1) // request.block_size)
        return min(self.matched_blocks(request, replica_id), cacheable) * request.block_size

    def prefill_tokens(self, request: RouteRequest, replica_id: str) -> int:
        return max(0, request.prompt_len - self.matched_blocks(request, replica_id) * request.block_size)

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        pending = self.work.scores(views)  # pending work and the wait for a slot
        matched = self.matched(request, views)
        bound = self.balance_ratio * min(pending) + self.balance_tokens
        # `prefill_tokens` per replica, inlined (it is asked of every replica), the same
        # product for every replica that holds none of the prompt
        prompt_len, block_size, weight = request.prompt_len, request.block_size, self.miss_weight
        miss_all, get = weight * max(0, prompt_len), matched.get
        return [
            p + (weight * max(0, prompt_len - held * block_size) if (held := get(v.replica_id, 0)) else miss_all)
            if p <= bound
            else math.inf
            for v, p in zip(views, pending)
        ]

    def dispatched(self, request: RouteRequest, replica_id: str, now: float) -> None:
        super().dispatched(request, replica_id, now)
        self.remember(request, replica_id)


class PrecisePrefix(PrefixAffinity):
    """`prefix_affinity`'s pricing and imbalance guard over what the replicas' caches actually
    hold, as their K/V events report it (`router.block_index.BlockIndex`, which the router keeps
    from the load reports), not what the router's own decisions suggest. Score: prompt tokens
    outside the replica's longest cached prefix of the prompt plus its pending work; a replica
    past the guard's bound scores +inf. The prompt blocks of requests in flight on a replica
    count as cached there too (`InFlightBlocks`): it computes them on admission and cannot evict
    them while they run, and no K/V event can say so before the prefill is done, so a burst on
    one new prefix follows its first request instead of computing the prefix once per replica.

    Its defaults price a miss at twice a token of pending work and allow 4,096 tokens of pending
    work over the least loaded before the guard excludes a replica: with the guard at 1,024 a
    replica that holds the prefix and is prefilling one other request's miss is already out, and
    its hits go to replicas that must compute the prefix again and evict another for it.

    Placement (typically of a prefix no replica holds): among the replicas that score within
    `placement_slack` tokens of the best and match as much of the prompt as the best does, the
    one whose cache holds the fewest blocks (indexed or in flight), so the new prefix evicts
    the least and prefixes partition over the replicas instead of each replica cycling through
    all of them; remaining ties at random (seeded), so misses never all land on one replica,
    the hotspot users of cache-aware routers report."""

    name = "precise_prefix"

    def __init__(
        self,
        seed: int = 0,
        placement_slack: float = 512.0,
        miss_weight: float = 2.0,
        balance_tokens: float = 4096.0,
        **pricing: float,
    ):
        """`pricing`: `prefix_affinity`'s `decode_weight` and `balance_ratio`."""
        super().__init__(seed, miss_weight=miss_weight, balance_tokens=balance_tokens, **pricing)
        self.placement_slack = placement_slack
        self.index = BlockIndex()  # until the router attaches its own
        self.in_flight = InFlightBlocks()

    def attach_block_index(self, index: BlockIndex) -> None:
        self.index = index

    def cached_blocks(self, request: RouteRequest, views: list[ReplicaView]) -> dict[str, int]:
        cacheable = _cacheable(request)
        matched = self.index.matched_blocks(cacheable, [v.replica_id for v in views])
        for replica_id, n in self.in_flight.matched_blocks(cacheable).items():
            if n > matched.get(replica_id, n):  # a replica not in `views` is left out
                matched[replica_id] = n
        return matched

    def remember(self, request: RouteRequest, replica_id: str) -> None:
        self.index.touch(replica_id, request.block_hashes[: self.matched_blocks(request, replica_id)])
        self.in_flight.add(request.request_id, replica_id, _cacheable(request))

    def completed(self, request_id: str, output_len: int | None) -> None:
        super().completed(request_id, output_len)
        self.in_flight.remove(request_id)

    def choose(self, request: RouteRequest, views: list[ReplicaView]) -> tuple[int, list[float]]:
        scores = self.scores(request, views)
        matched = self._matched[1]  # what `scores` found: `matched_blocks` per replica, inlined
        best = scores.index(min(scores))  # the first lowest (no score is NaN)
        depth = matched.get(views[best].replica_id, 0)
        bar = scores[best] + self.placement_slack
        near = [i for i, s in enumerate(scores) if s <= bar and matched.get(views[i].replica_id, 0) == depth]
        held = {
            i: self.index.num_blocks(views[i].replica_id) + self.in_flight.num_blocks(views[i].replica_id) for i in near
        }
        fewest = min(held.values())
        return self.rng.choice([i for i in near if held[i] == fewest]), scores


class PredictedLatency(PrecisePrefix):
    """The lowest predicted TTFT among the replicas whose predicted TPOT meets `tpot_slo` (every
    replica, when none does): each replica's queue walked step by step at its own step prices,
    corrected by its observed error (`router.predicted_latency.LatencyModel`), with prompt
    prefixes as `precise_prefix` knows them. Score: the predicted TTFT in seconds (+inf: over
    the TPOT SLO); ties take turns, not `precise_prefix`'s placement."""

    name = "predicted_latency"
    uses_tpot_slo = True
    choose = RoutingPolicy.choose

    def __init__(self, seed: int = 0, tpot_slo: float = defaults.TPOT_SLO, **pricing: float):
        """`tpot_slo`: the TPOT limit the run is judged by (`make_routing_policy` passes it);
        `pricing`: `precise_prefix`'s (its pending-work ledger and length estimates)."""
        super().__init__(seed, **pricing)
        self.latency = LatencyModel(tpot_slo)

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        return self.latency.scores(request, views, self.matched(request, views), self.lengths.estimate(request))

    def dispatched(self, request: RouteRequest, replica_id: str, now: float) -> None:
        super().dispatched(request, replica_id, now)
        self.latency.dispatched(request, replica_id, now, self.lengths.estimate(request))

    def completed(self, request_id: str, output_len: int | None) -> None:
        super().completed(request_id, output_len)
        self.latency.completed(request_id, output_len)

    def reported(self, load: LoadReport) -> None:
        self.latency.reported(load)

    def predicted_ttft(self, replica_id: str) -> float | None:
        return self.latency.predicted_ttft(replica_id)


def _cacheable(request: RouteRequest) -> tuple[int, ...]:
    """The prompt's block hashes a prefix cache can hit: not the block of its last token."""
    return request.block_hashes[: max(0, (request.prompt_len - 1) // request.block_size)]


ROUTING_POLICIES: Registry[type[RoutingPolicy]] = Registry.of_named(
    "routing policy",
    (
        RoundRobin,
        RandomChoice,
        LeastQueue,
        MostFreeSlots,
        LeastLoaded,
        PowerOfTwo,
        SessionAffinity,
        LeastWork,
        PredictedLength,
        PrefixAffinity,
        PrecisePrefix,
        PredictedLatency,
    ),
)

DEFAULT_POLICY = LeastLoaded.name


def make_routing_policy(name: str, seed: int = 0, tpot_slo: float = defaults.TPOT_SLO) -> RoutingPolicy:
    """The policy `name`, seeded; `tpot_slo`: the TPOT limit (seconds per output token) of the
    SLO the run is judged by, which the policies that predict TPOT route within."""
    policy = ROUTING_POLICIES[name]
    return policy(seed=seed, tpot_slo=tpot_slo) if policy.uses_tpot_slo else policy(seed=seed)
