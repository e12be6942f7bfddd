"""The router: picks a replica for each request from its own view of replica load.

`Router` and the routing policies are pure (no Ray; an injected clock), so the same objects
run in the cluster and in the simulator. The Ray actor around them lives in `router.actor`,
which is not imported here, so importing `router` does not import Ray.
"""

from protocol.messages import LoadReport
from protocol.routing import RouteRequest
from router.errors import RoutingError
from router.load import LoadView, ReplicaView
from router.policies import DEFAULT_POLICY, ROUTING_POLICIES, RoutingPolicy, make_routing_policy
from router.router import Decision, Router

__all__ = [
    "DEFAULT_POLICY",
    "ROUTING_POLICIES",
    "Decision",
    "LoadReport",
    "LoadView",
    "ReplicaView",
    "RouteRequest",
    "Router",
    "RoutingError",
    "RoutingPolicy",
    "make_routing_policy",
]
