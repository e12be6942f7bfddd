"""The routing policies compared by slotserve. Each scores every replica (lower is better)
from the router's load view and the base class picks the lowest, so a decision can be logged
with all its scores and two policies differ in their scoring and nothing else.

Ties go to the first tied replica at or after a cursor that moves past every choice, so equal
replicas take turns rather than the first one filling up; the order is deterministic.

Policies are pure: no Ray, no clock of their own (report ages come in the views), randomness
from a seeded `random.Random`. A policy that keeps state about requests (reserved work, an
output-length estimate, a prefix index) hears of each dispatch and completion through
`dispatched` and `completed`, which the router calls.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from protocol.registry import Registry
from protocol.routing import RouteRequest
from router.block_index import BlockIndex, InFlightBlocks
from router.length_predictor import BucketedLength, MeanLength
from router.load import ReplicaView
from router.prefix_index import CAPACITY_BLOCKS, PrefixIndex
from router.work import DECODE_WEIGHT, WorkLedger


class RoutingPolicy:
    name: str = ""
    uses_load = True  # whether decisions depend on load reports (else their signal age is None)

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self._cursor = 0

    def choose(self, request: RouteRequest, views: list[ReplicaView]) -> tuple[int, list[float]]:
        """Index of the chosen replica in `views`, and one score per replica."""
        scores = self.scores(request, views)
        return self._pick(scores), scores

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        raise NotImplementedError

    def dispatched(self, request: RouteRequest, replica_id: str, now: float) -> None:
        """The router sent `request` to `replica_id` (after `choose`)."""

    def completed(self, request_id: str, output_len: int | None) -> None:
        """The request ended, having made `output_len` tokens (None: not known)."""

    def attach_block_index(self, index: BlockIndex) -> None:
        """The router's precise block index (kept from the replicas' K/V events); a policy
        that scores by it keeps it."""

    def _pick(self, scores: list[float]) -> int:
        best = min(scores)
        n = len(scores)
        index = next(i for i in ((self._cursor + k) % n for k in range(n)) if scores[i] == best)
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

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        return [v.load_score for v in views]


class PowerOfTwo(RoutingPolicy):
    """Two replicas sampled at random, the less loaded of them taken (as Ray Serve does): it
    needs a fresh look at only two replicas. Unsampled replicas score +inf."""

    name = "power_of_two"

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        sampled = set(self.rng.sample(range(len(views)), min(2, len(views))))
        return [v.load_score if i in sampled else math.inf for i, v in enumerate(views)]


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
        return [self.work.score(v) for v in views]

    def dispatched(self, request: RouteRequest, replica_id: str, now: float) -> None:
        self.work.reserve(request.request_id, replica_id, request.prompt_len, self.lengths.estimate(request), now)
        self._in_flight[request.request_id] = request

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
    replica's pending work (`predicted_length`'s estimate).

    Imbalance guard (after SGLang's cache-aware router): a replica whose pending work exceeds
    `balance_ratio` x the least pending work plus `balance_tokens` is not eligible (+inf), so a
    popular prefix cannot pile requests onto one replica; its requests spill to the next
    cheapest, which then caches the prefix too. Requests without block hashes are placed by
    pending work alone."""

    name = "prefix_affinity"

    def __init__(
        self,
        seed: int = 0,
        decode_weight: float = DECODE_WEIGHT,
        balance_ratio: float = 1.5,
        balance_tokens: float = 1024.0,
        capacity_blocks: int = CAPACITY_BLOCKS,
    ):
        super().__init__(seed, decode_weight)
        self.balance_ratio, self.balance_tokens = balance_ratio, balance_tokens
        self.index = PrefixIndex(capacity_blocks)

    def matched(self, request: RouteRequest, views: list[ReplicaView]) -> dict[str, int]:
        """How many of the prompt's leading blocks each replica holds, as this policy knows it."""
        return self.index.matched_blocks(request.block_hashes, [v.replica_id for v in views])

    def remember(self, request: RouteRequest, replica_id: str) -> None:
        """What the index learns from a dispatch: here, that the replica will hold the prompt."""
        self.index.insert(replica_id, request.block_hashes)

    def scores(self, request: RouteRequest, views: list[ReplicaView]) -> list[float]:
        pending = [self.work.score(v) for v in views]  # pending work and the wait for a slot
        matched = self.matched(request, views)
        bound = self.balance_ratio * min(pending) + self.balance_tokens
        return [
            p + max(0, request.prompt_len - matched[v.replica_id] * request.block_size) if p <= bound else math.inf
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

    Ties (typically a prefix no replica holds, on equally loaded replicas) go to one of the
    tied replicas at random (seeded), so misses spread over the least loaded rather than all
    landing on one replica, the hotspot users of cache-aware routers report."""

    name = "precise_prefix"

    def __init__(self, seed: int = 0, **pricing: float):
        """`pricing`: `prefix_affinity`'s `decode_weight`, `balance_ratio` and `balance_tokens`."""
        super().__init__(seed, **pricing)
        self.index = BlockIndex()  # until the router attaches its own
        self.in_flight = InFlightBlocks()
        self._matched: dict[str, int] = {}  # the last scoring's matches, for `remember`

    def attach_block_index(self, index: BlockIndex) -> None:
        self.index = index

    def matched(self, request: RouteRequest, views: list[ReplicaView]) -> dict[str, int]:
        cacheable = _cacheable(request)
        self._matched = self.index.matched_blocks(cacheable, [v.replica_id for v in views])
        for replica_id, n in self.in_flight.matched_blocks(cacheable).items():
            if n > self._matched.get(replica_id, n):  # a replica not in `views` is left out
                self._matched[replica_id] = n
        return self._matched

    def remember(self, request: RouteRequest, replica_id: str) -> None:
        self.index.touch(replica_id, request.block_hashes[: self._matched.get(replica_id, 0)])
        self.in_flight.add(request.request_id, replica_id, _cacheable(request))

    def completed(self, request_id: str, output_len: int | None) -> None:
        super().completed(request_id, output_len)
        self.in_flight.remove(request_id)

    def _pick(self, scores: list[float]) -> int:
        best = min(scores)
        return self.rng.choice([i for i, s in enumerate(scores) if s == best])


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
    ),
)

DEFAULT_POLICY = LeastLoaded.name


def make_routing_policy(name: str, seed: int = 0) -> RoutingPolicy:
    return ROUTING_POLICIES[name](seed=seed)
