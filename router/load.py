"""The router's view of replica load: what each replica last reported, and what the router
itself has sent there since.

Reports arrive late (a replica reports every so often; a request dispatched a millisecond
ago is in no report yet), so the router counts its own in-flight requests per replica and
corrects the last report with them. Without that, two requests routed back to back would both
see the same single free slot and both go there.

Estimation rule (one place, used by every policy):

- `unseen = max(0, in_flight - (report.running + report.queue_depth))`: requests the router
  has outstanding on the replica beyond what the report accounts for. The router is the
  replica's only source of requests, so anything above the reported running + queued count
  was dispatched after the report was taken (or was still on its way).
- Those unseen requests take the reported free slots first, then queue:
  `est_free_slots = max(0, free_slots - unseen)`,
  `est_queue = queue_depth + max(0, unseen - free_slots)`.
- The load score the default policy uses is `est_queue - est_free_slots`: a new request's
  distance from a free slot (negative: that many slots to spare; positive: that many requests
  ahead of it). Each request routed there raises it by exactly one.

The rule errs towards over-estimating load: a request that finished on the replica counts as
unseen until its completion reaches the router. If a report counts requests the router does
not know of (a restarted router), unseen is 0 and the report is taken as it is. Before a
replica's first report the router knows only its own count: everything in flight is queued,
no slot is known to be free.

The replicas a request may go to now (up and under the router's per-replica bound) are kept in
an index (`RoutableIndex`), updated on every dispatch, completion, report and state change, so
that a policy which only needs the least loaded of them, or two of them at random, finds them
in O(log n) without looking at every replica, which at hundreds of replicas would be most of
a decision's work.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from typing import NamedTuple

from protocol.messages import LoadReport
from router.errors import RoutingError


def load_score(in_flight: int, report: LoadReport | None) -> float:
    """`est_queue - est_free_slots` (see the module docstring), computed as
    `queue_depth + unseen - free_slots`, since max(0, u - f) - max(0, f - u) = u - f.
    Lower is better."""
    if report is None:
        return float(in_flight)
    unseen = max(0, in_flight - report.running - report.queue_depth)
    return float(report.queue_depth + unseen - report.free_slots)


class ReplicaView(NamedTuple):
    """One replica as the router sees it at one moment, with the estimates policies use. A
    named tuple: a decision that scores every replica builds one per replica, and a tuple is
    built about three times faster than a frozen dataclass."""

    replica_id: str
    in_flight: int
    report: LoadReport | None
    report_age: float | None

    @property
    def unseen(self) -> int:
        """Requests in flight here that the last report cannot account for."""
        if self.report is None:
            return self.in_flight
        return max(0, self.in_flight - self.report.running - self.report.queue_depth)

    @property
    def est_free_slots(self) -> int:
        if self.report is None:
            return 0
        return max(0, self.report.free_slots - self.unseen)

    @property
    def est_queue(self) -> int:
        if self.report is None:
            return self.in_flight
        return self.report.queue_depth + max(0, self.unseen - self.report.free_slots)

    @property
    def load_score(self) -> float:
        """See `load_score`."""
        return load_score(self.in_flight, self.report)


class RoutableIndex:
    """The routable replicas, ranked in the order they were added (a replica's rank is its
    index in the list of routable views a policy is given), and bucketed by load score: the
    least loaded at or after a rank, and the replica at a rank, are found by bisection.

    Each replica carries a sequence number from its addition, so ranks follow the order of
    addition while replicas come and go. Bucket scores are held in a heap with lazy deletion
    (an emptied bucket's score stays until it reaches the top), rebuilt when stale entries
    outnumber live ones, so it stays within twice the distinct scores."""

    def __init__(self) -> None:
        self._ranked: list[int] = []  # sequence numbers of the routable replicas, ascending
        self._ids: dict[int, str] = {}  # sequence number -> replica id, routable ones
        self._held: dict[str, tuple[int, float]] = {}  # replica id -> (sequence number, score)
        self._buckets: dict[float, list[int]] = {}  # score -> sequence numbers, ascending
        self._scores: list[float] = []  # heap of bucket scores, some of emptied buckets
        # the routable replicas in rank order and their scores, built when asked after a change
        self._order: list[str] | None = None
        self._ranked_scores: list[float] | None = None

    def __len__(self) -> int:
        return len(self._ranked)

    def put(self, replica_id: str, seq: int, score: float | None) -> None:
        """The replica is routable with `score`, or not routable (None)."""
        held = self._held.get(replica_id)
        if held is not None:
            if held[1] == score:
                return
            self._ranked_scores = None
            bucket = self._buckets[held[1]]
            del bucket[bisect_left(bucket, seq)]
            if not bucket:
                del self._buckets[held[1]]
            if score is None:
                del self._ranked[bisect_left(self._ranked, seq)], self._ids[seq], self._held[replica_id]
                self._order = None
                return
        elif score is None:
            return
        else:
            insort(self._ranked, seq)
            self._ids[seq] = replica_id
            self._order = self._ranked_scores = None
        self._held[replica_id] = (seq, score)
        bucket = self._buckets.get(score)
        if bucket is not None:
            insort(bucket, seq)
            return
        self._buckets[score] = [seq]
        if len(self._scores) > 2 * len(self._buckets):
            self._scores = list(self._buckets)
            heapq.heapify(self._scores)
        else:
            heapq.heappush(self._scores, score)

    def replica_at(self, rank: int) -> str:
        return self._ids[self._ranked[rank]]

    def score_at(self, rank: int) -> float:
        return self._held[self.replica_at(rank)][1]

    def replica_ids(self) -> list[str]:
        """The routable replicas in rank order."""
        return list(self.ordered_ids())

    def ordered_ids(self) -> list[str]:
        """`replica_ids`, the list kept until the next change (not to be changed by the caller):
        a decision that builds every replica's figures asks for it once, and between two
        decisions most replicas change nothing."""
        if self._order is None:
            ids = self._ids
            self._order = [ids[seq] for seq in self._ranked]
        return self._order

    def ordered_scores(self) -> list[float]:
        """The routable replicas' load scores in rank order (kept likewise, not to be changed):
        each replica's `ReplicaView.load_score`, held since its last change."""
        if self._ranked_scores is None:
            held = self._held
            self._ranked_scores = [held[replica_id][1] for replica_id in self.ordered_ids()]
        return self._ranked_scores

    def least_loaded(self, start: int) -> int:
        """The rank of the lowest-scored replica, the first of those tied at or after rank
        `start` (wrapping round to rank 0): `RoutingPolicy._pick`'s choice over every score."""
        scores, buckets = self._scores, self._buckets
        while scores[0] not in buckets:
            heapq.heappop(scores)
        bucket = buckets[scores[0]]
        i = bisect_left(bucket, self._ranked[start])
        return bisect_left(self._ranked, bucket[i] if i < len(bucket) else bucket[0])


class LoadView:
    """Per-replica in-flight counts and last reports. Replicas keep the order they were added
    in, which is the index order policies see. A replica is routable while it is up (not
    `set_down`) and has fewer than `max_in_flight_per_replica` requests in flight; the
    routable ones are indexed (`routable`), and the requests in flight on replicas that are up
    counted (`up_in_flight`), as every change is made."""

    def __init__(self, replica_ids: list[str], max_in_flight_per_replica: float = math.inf):
        self.max_in_flight_per_replica = max_in_flight_per_replica
        self._in_flight: dict[str, int] = {}
        self._reports: dict[str, LoadReport] = {}
        self._owner: dict[str, str] = {}  # request_id -> replica_id, for requests in flight
        self._seq: dict[str, int] = {}  # replica id -> its sequence number (order of addition)
        self._next_seq = 0
        self._down: set[str] = set()
        self._counted: dict[str, int] = {}  # replica id -> its requests counted in up_in_flight
        self.routable = RoutableIndex()
        self._routable_in_flight: dict[str, int] | None = None  # see `routable_in_flight`
        self.oldest_age: float | None = None  # see `routable_views`
        self.up_in_flight = 0
        self.unknown_completions = 0
        self.stale_reports = 0
        self.unknown_reports = 0
        for replica_id in replica_ids:
            self.add_replica(replica_id)

    @property
    def replica_ids(self) -> list[str]:
        return list(self._in_flight)

    def knows(self, replica_id: str) -> bool:
        return replica_id in self._in_flight

    def add_replica(self, replica_id: str) -> None:
        if replica_id in self._in_flight:
            raise RoutingError(f"replica {replica_id!r} is already routed to")
        self._in_flight[replica_id] = 0
        self._seq[replica_id], self._next_seq = self._next_seq, self._next_seq + 1
        self._refresh(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica. Its in-flight requests are forgotten too: their completions, if
        they ever come, count as unknown."""
        self.require(replica_id)
        self.routable.put(replica_id, self._seq.pop(replica_id), None)
        self._routable_in_flight = None
        self.up_in_flight -= self._counted.pop(replica_id)
        self._down.discard(replica_id)
        del self._in_flight[replica_id]
        self._reports.pop(replica_id, None)
        self._owner = {req: rep for req, rep in self._owner.items() if rep != replica_id}

    def set_down(self, replica_id: str, down: bool) -> None:
        """Whether the replica is down (routed nothing, its requests not counted up)."""
        self.require(replica_id)
        if down:
            self._down.add(replica_id)
        else:
            self._down.discard(replica_id)
        self._refresh(replica_id)

    @property
    def up_count(self) -> int:
        """Replicas that are not down."""
        return len(self._in_flight) - len(self._down)

    def routable_views(self, now: float) -> list[ReplicaView]:
        """The routable replicas' views, in rank order (see `views` for the ages). Built as
        `view` builds one, inlined: every decision that scores every replica builds them all.
        The oldest of their report ages is left in `oldest_age` (None: none has reported), the
        signal age of a decision that scored every one of them finitely."""
        reports, in_flight, make = self._reports, self._in_flight, tuple.__new__
        views, oldest = [], None
        for replica_id in self.routable.ordered_ids():
            report = reports.get(replica_id)
            if report is None:
                views.append(make(ReplicaView, (replica_id, in_flight[replica_id], None, None)))
            else:
                age = now - report.time
                age = age if age > 0.0 else 0.0
                if oldest is None or age > oldest:
                    oldest = age
                views.append(make(ReplicaView, (replica_id, in_flight[replica_id], report, age)))
        self.oldest_age = oldest
        return views

    def routable_in_flight(self) -> dict[str, int]:
        """Requests in flight per routable replica, in rank order: `in_flight` of each of the
        `routable_views`, kept as requests come and go (not to be changed by the caller; a
        decision's figures copy it)."""
        if self._routable_in_flight is None:
            in_flight = self._in_flight
            self._routable_in_flight = {r: in_flight[r] for r in self.routable.ordered_ids()}
        return self._routable_in_flight

    def view(self, replica_id: str, now: float) -> ReplicaView:
        report = self._reports.get(replica_id)
        age = None if report is None else max(0.0, now - report.time)
        return ReplicaView(replica_id, self._in_flight[replica_id], report, age)

    def _refresh(self, replica_id: str) -> None:
        """Bring the replica's entry in the index and its count in `up_in_flight` up to date."""
        in_flight = self._in_flight[replica_id]
        up = replica_id not in self._down
        counted = in_flight if up else 0
        self.up_in_flight += counted - self._counted.get(replica_id, 0)
        self._counted[replica_id] = counted
        routable = up and in_flight < self.max_in_flight_per_replica
        score = load_score(in_flight, self._reports.get(replica_id)) if routable else None
        self.routable.put(replica_id, self._seq[replica_id], score)
        kept = self._routable_in_flight
        if kept is not None:
            if routable and replica_id in kept:
                kept[replica_id] = in_flight
            elif routable or replica_id in kept:  # it joined or left the routable: ranks move
                self._routable_in_flight = None

    def owner(self, request_id: str) -> str | None:
        """The replica a request is in flight on, or None."""
        return self._owner.get(request_id)

    def dispatched(self, replica_id: str, request_id: str) -> None:
        self.require(replica_id)
        if request_id in self._owner:
            raise RoutingError(f"request {request_id!r} is already in flight on {self._owner[request_id]!r}")
        self._owner[request_id] = replica_id
        self._in_flight[replica_id] += 1
        self._refresh(replica_id)

    def completed(self, request_id: str, replica_id: str | None = None) -> bool:
        """Idempotent: a second completion, one for an id never routed, or one from a replica
        the request has since been moved off (`replica_id` given and not its owner) changes
        nothing and is counted in `unknown_completions`. Returns whether it was in flight."""
        owner = self._owner.get(request_id)
        if owner is None or (replica_id is not None and replica_id != owner):
            self.unknown_completions += 1
            return False
        del self._owner[request_id]
        self._in_flight[owner] -= 1
        self._refresh(owner)
        return True

    def forget_in_flight(self, replica_id: str) -> list[str]:
        """The replica is lost: drop the requests in flight on it (their clients move them
        elsewhere) and its last report. Returns their ids."""
        self.require(replica_id)
        lost = [req for req, rep in self._owner.items() if rep == replica_id]
        for request_id in lost:
            del self._owner[request_id]
        self._in_flight[replica_id] = 0
        self._reports.pop(replica_id, None)
        self._refresh(replica_id)
        return lost

    def update(self, report: LoadReport) -> bool:
        """Keep the report unless one taken later is already held (reports can overtake each
        other on the way). Returns whether it was kept."""
        if not self.knows(report.replica_id):
            self.unknown_reports += 1  # e.g. a removed replica's last words
            return False
        held = self._reports.get(report.replica_id)
        if held is not None and report.time < held.time:
            self.stale_reports += 1
            return False
        self._reports[report.replica_id] = report
        self._refresh(report.replica_id)
        return True

    def last_reports(self) -> dict[str, LoadReport]:
        """The last report kept from each replica that has reported."""
        return dict(self._reports)

    def views(self, now: float) -> list[ReplicaView]:
        """Report ages are `now - report.time`, clamped at 0 (clock skew between processes)."""
        return [self.view(replica_id, now) for replica_id in self._in_flight]

    def require(self, replica_id: str) -> None:
        if replica_id not in self._in_flight:
            raise RoutingError(f"unknown replica {replica_id!r}; known: {', '.join(self._in_flight) or 'none'}")
