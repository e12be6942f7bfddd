"""Chained hashes of a prompt's full blocks: the key a paged prefix cache files a block under
(`replica.scheduling.block_manager`), also what a router's prefix index and a workload's best-possible
prefix hit rate are computed from, so all three name the same prefix the same way.

The hash of block i covers every token before it (`hash((hash of block i-1, *tokens of block
i))`, the first chained from NO_PARENT), so equal hashes mean equal whole prefixes. Python
hashes tuples of ints the same in every process (no hash randomisation for ints), so a
client, the router and a replica agree."""

from __future__ import annotations

from collections.abc import Sequence

NO_PARENT = -1  # the chain's seed for a prompt's first block (an int: hash(None) varies between runs)


def chain(parent: int, block: Sequence[int]) -> int:
    """The hash of one full block following the block hashed `parent` (NO_PARENT for the first)."""
    return hash((parent, *block))


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """The chained hashes of the first `num_blocks` full blocks (all full blocks if None)."""
    full = len(token_ids) // block_size
    count = full if num_blocks is None else min(num_blocks, full)
    out, parent = [], NO_PARENT
    for i in range(count):
        parent = chain(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def cacheable_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes a prefix cache can hit for this prompt: its full blocks before the one
    holding the last token (that token is always computed, so the request can sample)."""
    return block_hashes(token_ids, block_size, (len(token_ids) - 1) // block_size)
