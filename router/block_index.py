"""The router's precise index of which replica holds which prompt blocks, kept from the K/V
events the replicas send on their load reports (`protocol.messages.KvEvents`), after llm-d's
precise prefix-cache scorer. Unlike the approximate `router.prefix_index` (inferred from the
router's own decisions), it knows what each replica's cache actually stored and evicted, up to
the age of the replica's last report.

Batches are applied in their numbered order: one that arrives early is held until the ones
before it come (reports can overtake each other on the way), and past `max_held` held batches
the missing one counts as lost. The index then drops what it holds of that replica (better to
know nothing than to believe blocks that may be gone) and lists it in `take_snapshot_requests`,
so whoever carries messages to the replica can ask it for a snapshot; a batch with `reset` (a
snapshot, which a replica also sends when it starts or restarts) replaces the replica's entries.
Until a replica's first snapshot, its batches are ignored, so a router that restarted does not
apply changes to a cache it never saw.

Memory is bounded: each replica keeps at most `capacity_blocks` hashes, least recently used
first out (a stored block and a routed hit refresh a hash), and a hash's holders are one int
used as a bitmask over the replicas (one bit each), not a set per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from protocol.messages import KvEvents
from router.errors import RoutingError

CAPACITY_BLOCKS = 4096  # hashes kept per replica (64k tokens at 16 per block)
MAX_HELD = 8  # batches held ahead of a missing one before it counts as lost


class BlockIndex:
    def __init__(self, capacity_blocks: int = CAPACITY_BLOCKS, max_held: int = MAX_HELD):
        if capacity_blocks < 1 or max_held < 0:
            raise RoutingError(
                f"a block index needs capacity_blocks >= 1 and max_held >= 0; got {capacity_blocks}, {max_held}"
            )
        self.capacity_blocks, self.max_held = capacity_blocks, max_held
        self._bit: dict[str, int] = {}  # replica -> its bit in the holder masks
        self._replica_of: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._blocks: dict[str, dict[int, None]] = {}  # replica -> its hashes, least recently used first
        self._holders: dict[int, int] = {}  # hash -> mask of the replicas holding it
        self._next_seq: dict[str, int] = {}  # replica -> number of the batch expected next
        self._held: dict[str, dict[int, KvEvents]] = {}  # replica -> batches that came early, by number
        self._wanted: set[str] = set()  # replicas whose index was dropped, until their snapshot
        self._asked: set[str] = set()  # of those, the ones already handed out by take_snapshot_requests
        self._alive: tuple[tuple[str, ...], int] = ((), 0)  # the last replicas looked up, their bits' mask
        self.gaps = 0  # batches counted as lost
        self.ignored = 0  # batches ignored: older than expected, or before a replica's first snapshot

    # ---- events ------------------------------------------------------------------------------
    def apply(self, replica_id: str, events: KvEvents) -> None:
        """One replica's batch, from its load report."""
        if events.reset:  # batches held early are dropped too: they may be a restarted replica's last life's
            self.forget(replica_id)
            self._apply(replica_id, events)
            self._next_seq[replica_id] = events.seq + 1
            return
        expected = self._next_seq.get(replica_id)
        if expected is None or events.seq < expected:
            self.ignored += 1
            if expected is None:
                self._wanted.add(replica_id)
            return
        if events.seq == expected:
            self._apply(replica_id, events)
            self._next_seq[replica_id] = expected + 1
            self._drain_held(replica_id)
            return
        held = self._held.setdefault(replica_id, {})
        held[events.seq] = events
        if len(held) > self.max_held:
            self.gaps += 1
            self.forget(replica_id)
            self._wanted.add(replica_id)

    def next_seq(self, replica_id: str) -> int | None:
        """The number of the replica's batch expected next (None: no snapshot of it yet)."""
        return self._next_seq.get(replica_id)

    def snapshot(self, replica_id: str) -> KvEvents | None:
        """What this index holds of the replica, as a batch another index can start from (a
        client routing on its own); None before the replica's first snapshot."""
        expected = self._next_seq.get(replica_id)
        if expected is None:
            return None
        return KvEvents(expected - 1, list(self._blocks.get(replica_id, {})), reset=True)

    def catch_up(self, replica_id: str, log: Iterable[KvEvents], expected: int | None) -> list[KvEvents]:
        """The batches another index expecting the replica's batch number `expected` (None: it
        has none yet) needs to hold what this one holds: those of `log` (the replica's recent
        batches, as they came) it has not seen, when they follow on from what it has; else (the
        log no longer reaches back that far) this index's `snapshot` of the replica and the
        batches after it. The snapshot is taken only then: it copies every block held."""
        batches = sorted(log, key=lambda b: b.seq)
        if expected is not None:
            newer = [b for b in batches if b.seq >= expected]
            if all(b.seq == expected + i for i, b in enumerate(newer)):
                return newer
        snapshot = self.snapshot(replica_id)
        if snapshot is None or (expected is not None and expected > snapshot.seq):
            return []
        return [snapshot, *(b for b in batches if b.seq > snapshot.seq)]

    def take_snapshot_requests(self) -> list[str]:
        """Replicas to ask for a snapshot (each once, until its snapshot comes)."""
        new = sorted(self._wanted - self._asked)
        self._asked.update(new)
        return new

    @property
    def snapshots_wanted(self) -> set[str]:
        return set(self._wanted)

    def forget(self, replica_id: str) -> None:
        """Drop everything known of the replica (removed, restarted, or its batches lost)."""
        bit = self._bit.pop(replica_id, None)
        if bit is not None:
            self._alive = ((), 0)
            for h in self._blocks.pop(replica_id):
                self._drop_holder(h, 1 << bit)
            del self._replica_of[bit]
            self._free_bits.append(bit)
        self._next_seq.pop(replica_id, None)
        self._held.pop(replica_id, None)
        self._wanted.discard(replica_id)
        self._asked.discard(replica_id)

    def _drain_held(self, replica_id: str) -> None:
        held = self._held.get(replica_id)
        while held and self._next_seq[replica_id] in held:
            self._apply(replica_id, held.pop(self._next_seq[replica_id]))
            self._next_seq[replica_id] += 1

    def _apply(self, replica_id: str, events: KvEvents) -> None:
        if replica_id not in self._bit:
            self._alive = ((), 0)
            bit = self._free_bits.pop() if self._free_bits else len(self._bit)
            self._bit[replica_id], self._replica_of[bit] = bit, replica_id
            self._blocks[replica_id] = {}
        bit, blocks = 1 << self._bit[replica_id], self._blocks[replica_id]
        for h in events.removed:
            if h in blocks:
                del blocks[h]
                self._drop_holder(h, bit)
        for h in events.stored:
            self._add(blocks, h, bit)
        while len(blocks) > self.capacity_blocks:
            old = next(iter(blocks))
            del blocks[old]
            self._drop_holder(old, bit)

    def _add(self, blocks: dict[int, None], h: int, bit: int) -> None:
        if h in blocks:
            del blocks[h]  # held already: put back as the most recently used
        else:
            self._holders[h] = self._holders.get(h, 0) | bit
        blocks[h] = None

    def _drop_holder(self, h: int, bit: int) -> None:
        holders = self._holders[h] & ~bit
        if holders:
            self._holders[h] = holders
        else:
            del self._holders[h]

    # ---- lookups -----------------------------------------------------------------------------
    def matched_blocks(self, hashes: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of the prompt its cache holds (as last reported)."""
        matched = dict.fromkeys(replica_ids, 0)
        alive = self._mask(replica_ids)
        for i, h in enumerate(hashes):
            if not alive:
                return matched
            holding = alive & self._holders.get(h, 0)
            if i:  # those without the first block stay at 0
                for replica_id in self._replicas(alive & ~holding):
                    matched[replica_id] = i
            alive = holding
        for replica_id in self._replicas(alive):
            matched[replica_id] = len(hashes)
        return matched

    def _mask(self, replica_ids: Sequence[str]) -> int:
        """The bits of those of `replica_ids` the index holds blocks of; kept for the next call
        with the same replicas (every decision asks it of the routable ones) until a replica
        gains or loses its bit."""
        key = tuple(replica_ids)
        if key == self._alive[0]:
            return self._alive[1]
        alive = 0
        for replica_id in key:
            bit = self._bit.get(replica_id)
            if bit is not None:
                alive |= 1 << bit
        self._alive = (key, alive)
        return alive

    def touch(self, replica_id: str, hashes: Sequence[int]) -> None:
        """A request using these blocks was sent to the replica: they are its most recently used."""
        blocks = self._blocks.get(replica_id)
        if blocks is None:
            return
        for h in hashes:
            if h in blocks:
                del blocks[h]
                blocks[h] = None

    def num_blocks(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))

    def holds(self, replica_id: str, block_hash: int) -> bool:
        return block_hash in self._blocks.get(replica_id, ())

    def _replicas(self, mask: int) -> Iterator[str]:
        while mask:
            low = mask & -mask
            yield self._replica_of[low.bit_length() - 1]
            mask ^= low


class InFlightBlocks:
    """The prompt blocks of the requests the router has in flight, per replica: a replica computes
    a request's prompt blocks when it admits it and cannot evict them while it runs, so they are
    as good as cached for the next request with that prefix, before any K/V event could say so
    (the report comes after the prefill). Counted per request, dropped at completion."""

    def __init__(self) -> None:
        self._holders: dict[int, dict[str, int]] = {}  # hash -> replica -> requests in flight holding it
        self._requests: dict[str, tuple[str, tuple[int, ...]]] = {}  # request id -> (replica, its hashes)
        self._distinct: dict[str, int] = {}  # replica -> distinct hashes its requests in flight hold

    def add(self, request_id: str, replica_id: str, hashes: Sequence[int]) -> None:
        self.remove(request_id)  # a request moved to another replica
        self._requests[request_id] = (replica_id, tuple(hashes))
        for h in hashes:
            holders = self._holders.setdefault(h, {})
            if replica_id not in holders:
                self._distinct[replica_id] = self._distinct.get(replica_id, 0) + 1
            holders[replica_id] = holders.get(replica_id, 0) + 1

    def remove(self, request_id: str) -> None:
        replica_id, hashes = self._requests.pop(request_id, (None, ()))
        for h in hashes:
            holders = self._holders[h]
            holders[replica_id] -= 1
            if not holders[replica_id]:
                del holders[replica_id]
                self._distinct[replica_id] -= 1
                if not holders:
                    del self._holders[h]

    def matched_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per replica with a request in flight sharing the prompt's first block, how many leading
        blocks of the prompt those requests hold (replicas with none are left out)."""
        first = self._holders.get(hashes[0]) if hashes else None
        if not first:
            return {}
        # block by block, the replicas still matching (set operations, not a walk per replica)
        depth: dict[str, int] = {}
        alive = set(first)
        for n in range(1, len(hashes)):
            holding = self._holders.get(hashes[n])
            still = alive.intersection(holding) if holding else set()
            for replica_id in alive - still:
                depth[replica_id] = n
            alive = still
            if not alive:
                break
        for replica_id in alive:
            depth[replica_id] = len(hashes)
        return {replica_id: depth[replica_id] for replica_id in first}  # in the first block's holders' order

    def num_blocks(self, replica_id: str) -> int:
        """Distinct blocks the requests in flight on the replica hold (cached there or soon)."""
        return self._distinct.get(replica_id, 0)

    def __len__(self) -> int:
        return len(self._requests)
