"""Chaos on a multi-node `ray.cluster_utils.Cluster`: 4 fake replicas on 3 worker nodes, 300
streamed requests, two replicas killed and one whole node removed while they run. Nothing is
lost or duplicated: every request completes with exactly the tokens of an undisturbed run."""

from __future__ import annotations

import pytest

from benchmarks.reliability import chaos_run


@pytest.mark.timeout(900)
def test_kills_and_a_removed_node_lose_and_duplicate_nothing():
    stats = chaos_run(num_requests=300, duration=8.0)
    assert len(stats.kills) == 3 and stats.kills[1].startswith("node")
    assert (stats.completed, stats.failed) == (300, 0), stats.errors[:3]
    assert (stats.duplicate_tokens, stats.missing_tokens, stats.wrong_outputs) == (0, 0, 0)
    assert stats.moved_requests > 0 and stats.migrations >= stats.moved_requests
