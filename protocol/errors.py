"""The base of every error slotserve raises on purpose; each package subclasses it with its own
typed errors, so a command line or an HTTP front end can tell user errors from bugs."""


class SlotServeError(Exception):
    """Base of every error slotserve raises on purpose."""


class OverloadedError(SlotServeError):
    """A bounded queue is full, so the request was refused at once instead of waiting without
    bound. `where` names the queue ("router", "replica-0"), `limit` its bound, and
    `retry_after` is the seconds after which a retry is likely to be accepted (an HTTP front end
    answers 503 with a Retry-After header)."""

    def __init__(self, where: str, limit: int, retry_after: float, detail: str = ""):
        self.where, self.limit, self.retry_after, self.detail = where, limit, retry_after, detail
        super().__init__(
            f"overloaded: {where} is at its limit of {limit}{f' ({detail})' if detail else ''}; "
            f"retry after {retry_after:.2f} s"
        )

    def __reduce__(self):  # so the error crosses process boundaries (Ray) intact
        return type(self), (self.where, self.limit, self.retry_after, self.detail)


class RequestLostError(SlotServeError):
    """A request could not be finished anywhere: every replica it was moved to failed, or none
    was left to take it. `attempts` counts the replicas tried."""

    def __init__(self, request_id: str, attempts: int, reason: str):
        self.request_id, self.attempts, self.reason = request_id, attempts, reason
        super().__init__(f"request {request_id!r} lost after {attempts} attempt(s): {reason}")

    def __reduce__(self):
        return type(self), (self.request_id, self.attempts, self.reason)


class DrainingError(OverloadedError):
    """The replica is draining (being removed or shut down) and admits nothing new; a client
    sends the request to another replica."""

    def __init__(self, where: str, limit: int = 0, retry_after: float = 0.0, detail: str = "draining"):
        super().__init__(where, limit, retry_after, detail)
