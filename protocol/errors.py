"""The base of every error slotserve raises on purpose; each package subclasses it with its own
typed errors, so a command line or an HTTP front end can tell user errors from bugs."""


class SlotServeError(Exception):
    """Base of every error slotserve raises on purpose."""
