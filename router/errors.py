"""The router's one error type. It says what was asked for and what is allowed."""

from protocol.errors import SlotServeError


class RoutingError(SlotServeError, ValueError):
    """An unknown policy or replica, no replicas at all, a duplicate request id, or a
    malformed load report."""
