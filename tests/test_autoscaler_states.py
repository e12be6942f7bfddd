"""What a restarted autoscaling controller takes the router's replicas to be (pure: no Ray
actor runs). A replica the router holds `starting` (routed nothing until its first health
answer) is not serving capacity: counting it serving would let the policy believe the
cluster larger than it is and hold off a scale-up it needs."""

from __future__ import annotations

from cluster.autoscaler import DRAINING, SERVING, STARTING, router_states


def test_a_restarted_controller_takes_each_replica_in_the_state_the_router_holds_it():
    """Starting and draining as the router's down reasons say; serving otherwise, a replica down
    for another reason (lost, unhealthy) included: it was serving, and is again once healthy."""
    down = {"replica-1": "starting", "replica-2": "draining", "replica-3": "no health answer within 15 s"}
    ids = ["replica-0", "replica-1", "replica-2", "replica-3"]
    assert router_states(ids, down) == {
        "replica-0": SERVING,
        "replica-1": STARTING,
        "replica-2": DRAINING,
        "replica-3": SERVING,
    }
    assert router_states(ids, {}) == dict.fromkeys(ids, SERVING)
