"""Each replica's pending work in tokens, as a router can know it: reserved at dispatch,
corrected by the replicas' load reports, released at completion.

A request reserves its prompt tokens (to prefill) and an expected output length (to decode)
on the replica it is sent to. A replica's pending work is then

- prefill: the prompt tokens its last report says are not computed yet
  (`LoadReport.prefill_tokens_pending`), plus the prompts of the requests it does not list:
  dispatched after it was taken, or before but not at the replica yet (on their way, or in its
  inbox while a step ran); with no report, every reserved prompt;
- decode: for each request in flight there, its expected output less the tokens its last
  report says it has made (`LoadReport.tokens_made`), at least 0. So the reservation is
  released as tokens are made, and wholly at completion.

A new request's wait for a slot (`slot_wait`, in decode steps) reads the same reservations:
the replica's requests in dispatch order, the first `num_slots` running, each later one taking
the first slot to free up, every running request making one token a step; the newcomer's slot
frees after that many steps (0 when a slot is free now). A request that has made more than
expected is taken to have one token left.

Work is counted in prefill-token equivalents: a decode token weighs `decode_weight` prefill
tokens, since at saturation a step computes many prompt tokens in the time it makes one token
for each running request (4 on this machine's fitted cost model: about 230 prefill and 44
decode tokens/s per replica at 8 slots; far more on a GPU).

A replica's score is kept from one call to the next until its reservations change or a new
report of it comes (`score` is asked of every replica at every decision, and between two
decisions most replicas neither take nor finish a request nor report).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from protocol.messages import LoadReport
from router.load import ReplicaView

DECODE_WEIGHT = 4.0


@dataclass(frozen=True)
class _Reservation:
    replica_id: str
    prefill: int
    decode: float
    time: float


class WorkLedger:
    def __init__(self, decode_weight: float = DECODE_WEIGHT):
        self.decode_weight = decode_weight
        self._reserved: dict[str, _Reservation] = {}  # request id -> what it reserved
        self._by_replica: dict[str, dict[str, _Reservation]] = {}
        # replica -> (the report its score was computed from, the score), until it changes
        self._scored: dict[str, tuple[LoadReport | None, float]] = {}

    def reserve(self, request_id: str, replica_id: str, prefill: int, decode: float, now: float) -> None:
        self.release(request_id)
        reservation = _Reservation(replica_id, prefill, decode, now)
        self._reserved[request_id] = reservation
        self._by_replica.setdefault(replica_id, {})[request_id] = reservation
        self._scored.pop(replica_id, None)

    def release(self, request_id: str) -> bool:
        """Drop a request's reservation; False if it held none (routed by another policy)."""
        reservation = self._reserved.pop(request_id, None)
        if reservation is None:
            return False
        del self._by_replica[reservation.replica_id][request_id]
        self._scored.pop(reservation.replica_id, None)
        return True

    def prefill_pending(self, view: ReplicaView) -> float:
        """Prompt tokens the replica has still to compute (see the module docstring)."""
        held = self._by_replica.get(view.replica_id)
        report = view.report
        if not held:  # most replicas of a large, lightly loaded cluster: no scan
            return 0.0 if report is None else float(report.prefill_tokens_pending)
        if report is None:
            return float(sum(r.prefill for r in held.values()))
        listed = report.tokens_made
        return report.prefill_tokens_pending + sum(
            r.prefill for request_id, r in held.items() if r.time > report.time or request_id not in listed
        )

    def decode_left(self, view: ReplicaView) -> list[float]:
        """Expected output tokens left per request in flight on the replica, in dispatch order."""
        held = self._by_replica.get(view.replica_id)
        if not held:
            return []
        made = view.report.tokens_made if view.report is not None else {}
        return [max(0.0, r.decode - made.get(rid, 0)) for rid, r in held.items()]

    def pending(self, view: ReplicaView) -> float:
        """The replica's pending work in prefill-token equivalents (see the module docstring)."""
        return self.prefill_pending(view) + self.decode_weight * sum(self.decode_left(view))

    def slot_wait(self, view: ReplicaView, decode_left: list[float] | None = None) -> float:
        """Decode steps until a new request would get a slot (see the module docstring);
        `decode_left`: the replica's `decode_left`, when the caller has it already."""
        left = [max(1.0, d) for d in (self.decode_left(view) if decode_left is None else decode_left)]
        slots = view.report.num_slots if view.report is not None else len(left) + 1
        if len(left) < slots:
            return 0.0
        running = left[:slots]
        heapq.heapify(running)
        for queued in left[slots:]:
            heapq.heappush(running, heapq.heappop(running) + queued)
        return running[0]

    def scores(self, views: list[ReplicaView]) -> list[float]:
        """`score` of each view (the kept ones looked up here, without a call each)."""
        get, score = self._scored.get, self.score
        return [kept[1] if (kept := get(v.replica_id)) is not None and kept[0] is v.report else score(v) for v in views]

    def score(self, view: ReplicaView) -> float:
        """What `least_work` minimises: the pending work plus the wait for a slot, a decode step
        weighed as a decode token (a new request is held back by both: by the prompts and
        outputs ahead of it, and, with every slot taken, by the steps until one frees). It
        reads the replica's reservations and last report alone, so the score is kept until
        either changes (a report is a frozen object: the same object, the same figures)."""
        scored = self._scored.get(view.replica_id)
        report = view.report
        if scored is not None and scored[0] is report:
            return scored[1]
        held = self._by_replica.get(view.replica_id)
        if not held or report is None:
            left, prefill = self.decode_left(view), self.prefill_pending(view)
        else:  # `decode_left` and `prefill_pending` in one pass over the reservations
            listed, taken, extra, left = report.tokens_made, report.time, 0, []
            for request_id, r in held.items():
                if r.time > taken or request_id not in listed:
                    extra += r.prefill
                left.append(max(0.0, r.decode - listed.get(request_id, 0)))
            prefill = report.prefill_tokens_pending + extra
        score = prefill + self.decode_weight * (sum(left) + self.slot_wait(view, left))
        self._scored[view.replica_id] = (report, score)
        return score
