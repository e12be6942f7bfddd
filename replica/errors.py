"""The engine's typed errors. Each says which field or limit was wrong, what was given, and what is allowed."""

from protocol.errors import SlotServeError


class InvalidRequestError(SlotServeError, ValueError):
    """A request field is missing, of the wrong type, or out of range; `field` names it."""

    def __init__(self, field: str, message: str):
        self.field, self.reason = field, message
        super().__init__(f"invalid request: {field}: {message}")

    def __reduce__(self):  # so the error crosses process boundaries (Ray) intact
        return type(self), (self.field, self.reason)


class RequestTooLongError(InvalidRequestError):
    """prompt + max_tokens can never fit in the model's context or the cache; the numbers are in the message."""


class InvariantViolation(SlotServeError, RuntimeError):
    """Scheduler or cache bookkeeping broke a rule that must always hold (a bug, never user error)."""


class ConfigError(SlotServeError, ValueError):
    """An engine or model configuration value is invalid or names something unknown."""
