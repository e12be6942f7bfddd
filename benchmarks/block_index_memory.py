"""Memory of the router's precise block index (`router.block_index.BlockIndex`) at cluster scale.

Fills the index for `--replicas` replicas the way their K/V events would: each replica's
snapshot of `--blocks` cached hashes (its cap, the worst case), a `--shared` share of them the
blocks of prefixes every replica holds (system prompts, documents) and the rest its own. Then
measures, with tracemalloc, the bytes the index holds (dicts, hash ints, holder masks), per
replica and per indexed block, and the time of one lookup of a 64-block prompt across all
replicas (what `precise_prefix` does per decision). A second fill past the cap checks that the
index stays at its bound.

    python benchmarks/block_index_memory.py [--replicas 256] [--blocks 4096] [--shared 0.25] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc

from protocol.messages import KvEvents
from router.block_index import CAPACITY_BLOCKS, BlockIndex


def fill(replicas: int, blocks: int, shared: float, seed: int = 0) -> tuple[BlockIndex, list[int]]:
    rng = random.Random(seed)
    common = [rng.getrandbits(63) for _ in range(int(blocks * shared))]
    index = BlockIndex(capacity_blocks=blocks)
    for r in range(replicas):
        own = [rng.getrandbits(63) for _ in range(blocks - len(common))]
        index.apply(f"r{r}", KvEvents(0, stored=common + own, reset=True))
    return index, common


def measure(replicas: int, blocks: int, shared: float) -> dict:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index, common = fill(replicas, blocks, shared)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    ids = [f"r{r}" for r in range(replicas)]
    prompt = common[:64]
    start, lookups = time.perf_counter(), 200
    for _ in range(lookups):
        index.matched_blocks(prompt, ids)
    lookup_s = (time.perf_counter() - start) / lookups
    index.apply("r0", KvEvents(1, stored=[random.getrandbits(63) for _ in range(blocks)]))  # past the cap
    indexed = replicas * blocks
    return {
        "replicas": replicas,
        "blocks_per_replica": blocks,
        "shared": shared,
        "bytes": held,
        "mib": held / 2**20,
        "bytes_per_replica": held / replicas,
        "bytes_per_block": held / indexed,
        "lookup_ms": lookup_s * 1e3,
        "r0_blocks_after_overfill": index.num_blocks("r0"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=CAPACITY_BLOCKS, help="hashes per replica (the index's cap)")
    parser.add_argument("--shared", type=float, default=0.25, help="share of each replica's blocks all replicas hold")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    row = measure(args.replicas, args.blocks, args.shared)
    print(
        f"{row['replicas']} replicas x {row['blocks_per_replica']} blocks ({row['shared']:.0%} shared): "
        f"{row['mib']:.1f} MiB, {row['bytes_per_replica'] / 2**10:.0f} KiB per replica, "
        f"{row['bytes_per_block']:.0f} B per indexed block; lookup of a 64-block prompt over all "
        f"replicas {row['lookup_ms']:.3f} ms; r0 after an overfill holds {row['r0_blocks_after_overfill']} blocks"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
