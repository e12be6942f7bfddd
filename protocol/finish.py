"""Why a request ended: one enum every package names the same way (the engine sets it, the
replica streams it in `StreamEvent.finish_reason`, the client and the metrics store read it),
and the one definition of which endings are natural."""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """Why a request ended; every request ends with exactly one. A StrEnum, so a reason read
    back from the metrics store as text compares equal to its member."""

    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # a stop token id or stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the step that ran it failed
    REJECTED = "rejected"  # refused at submission (cluster only; the engine raises instead)
    INVALID = "invalid"  # a bad request the HTTP ingress refused (its status is in the row's error)
    # Handed back by a draining replica for the client to continue elsewhere (cluster only;
    # the client resumes it on another replica, so no user ever sees this reason).
    MIGRATE = "migrate"


# The request ran to its own end: only then is its output length the one it would have, which
# length estimates learn from, and only then was it served (a metric's SLO counts no other).
NATURAL_ENDINGS = frozenset({FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH})
