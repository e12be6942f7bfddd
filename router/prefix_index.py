"""An approximate index of which replica holds which prompt blocks, after SGLang's cache-aware
router and Ray Serve's prefix tree: inferred from the router's own decisions (a request sent to
a replica leaves its prompt blocks in that replica's prefix cache), with each replica's entries
kept to the most recently used `capacity_blocks`, as its cache evicts the least recently used.

Blocks are named by chained hashes (`protocol.blocks`), so a block's hash stands for the whole
prefix up to it, and "replica r holds the first k blocks of this prompt" is a lookup per block.
The index is approximate in both directions: a replica may have evicted a block sooner (its
cache is shared with running requests' growth), or hold one the router did not send it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

CAPACITY_BLOCKS = 4096


class PrefixIndex:
    def __init__(self, capacity_blocks: int = CAPACITY_BLOCKS):
        self.capacity_blocks = capacity_blocks
        self._holders: dict[int, set[str]] = {}  # block hash -> replicas holding it
        self._lru: dict[str, OrderedDict[int, None]] = {}  # replica -> its blocks, least recently used first

    def matched_blocks(self, hashes: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of the prompt it holds."""
        matched = dict.fromkeys(replica_ids, 0)
        alive = set(replica_ids)
        for i, h in enumerate(hashes):
            holding = alive & self._holders.get(h, set())
            for replica_id in alive - holding:
                matched[replica_id] = i
            alive = holding
            if not alive:
                return matched
        for replica_id in alive:
            matched[replica_id] = len(hashes)
        return matched

    def insert(self, replica_id: str, hashes: Sequence[int]) -> None:
        """The replica now holds these blocks (most recently used), evicting its oldest past capacity."""
        lru = self._lru.setdefault(replica_id, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(replica_id)
        while len(lru) > self.capacity_blocks:
            old, _ = lru.popitem(last=False)
            holders = self._holders[old]
            holders.discard(replica_id)
            if not holders:
                del self._holders[old]

    def num_blocks(self, replica_id: str) -> int:
        return len(self._lru.get(replica_id, ()))
