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
"""

from __future__ import annotations

from typing import NamedTuple

from protocol.messages import LoadReport
from router.errors import RoutingError


class ReplicaView(NamedTuple):
    """One replica as the router sees it at one moment, with the estimates policies use. A
    named tuple: every decision builds one per replica (256 in the scale benchmark), and a
    tuple is built about three times faster than a frozen dataclass."""

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
        """`est_queue - est_free_slots` (see the module docstring), computed as
        `queue_depth + unseen - free_slots`, since max(0, u - f) - max(0, f - u) = u - f.
        Lower is better."""
        if self.report is None:
            return float(self.in_flight)
        return float(self.report.queue_depth + self.unseen - self.report.free_slots)


class LoadView:
    """Per-replica in-flight counts and last reports. Replicas keep the order they were added
    in, which is the index order policies see."""

    def __init__(self, replica_ids: list[str]):
        self._in_flight: dict[str, int] = {}
        self._reports: dict[str, LoadReport] = {}
        self._owner: dict[str, str] = {}  # request_id -> replica_id, for requests in flight
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

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica. Its in-flight requests are forgotten too: their completions, if
        they ever come, count as unknown."""
        self.require(replica_id)
        del self._in_flight[replica_id]
        self._reports.pop(replica_id, None)
        self._owner = {req: rep for req, rep in self._owner.items() if rep != replica_id}

    def owner(self, request_id: str) -> str | None:
        """The replica a request is in flight on, or None."""
        return self._owner.get(request_id)

    def dispatched(self, replica_id: str, request_id: str) -> None:
        self.require(replica_id)
        if request_id in self._owner:
            raise RoutingError(f"request {request_id!r} is already in flight on {self._owner[request_id]!r}")
        self._owner[request_id] = replica_id
        self._in_flight[replica_id] += 1

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
        return True

    def last_reports(self) -> dict[str, LoadReport]:
        """The last report kept from each replica that has reported."""
        return dict(self._reports)

    def views(self, now: float) -> list[ReplicaView]:
        """Report ages are `now - report.time`, clamped at 0 (clock skew between processes)."""
        reports = self._reports
        out = []
        for replica_id, in_flight in self._in_flight.items():
            report = reports.get(replica_id)
            age = None if report is None else max(0.0, now - report.time)
            out.append(ReplicaView(replica_id, in_flight, report, age))
        return out

    def require(self, replica_id: str) -> None:
        if replica_id not in self._in_flight:
            raise RoutingError(f"unknown replica {replica_id!r}; known: {', '.join(self._in_flight) or 'none'}")
