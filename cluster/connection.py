"""Joining the Ray cluster slotserve runs on, finding its router, and reading what a failed Ray
call means: a replica or router that is gone, or the typed error a request was refused with."""

from __future__ import annotations

import os
import socket

import ray

from protocol.errors import SlotServeError
from router.actor import ROUTER_ACTOR_NAME

NAMESPACE = "slotserve"


class ClusterError(SlotServeError):
    """No cluster where one was expected, or the cluster failed a request."""


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast on a dead address instead of letting ray.init retry for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except (OSError, ValueError) as err:
        raise ClusterError(
            f"cannot reach a Ray cluster at {address!r} ({err}); "
            "start one with `ray start --head` or give its HOST:PORT"
        ) from None


def _local_cluster_address() -> str:
    """The address `ray start` left on this machine (RAY_ADDRESS first), as ray.init("auto")
    would find it; ConnectionError when there is none."""
    from ray._private.services import canonicalize_bootstrap_address

    address = canonicalize_bootstrap_address("auto")
    if address is None:
        raise ConnectionError("no address recorded")
    return address


def use_token_auth(new_cluster: bool = False) -> None:
    """Send Ray's auth token when one is on this machine (~/.ray/auth_token, RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH) and RAY_AUTH_MODE is unset; `new_cluster`: for the local cluster about
    to start, whose token Ray makes if there is none. ray.init does this itself only for a
    cluster it finds on its own, never for an explicit address, so `--address` against a
    cluster with token auth (the default once a token exists) failed with InvalidAuthToken. A
    cluster without auth ignores the token. The mode is set here, not by Ray's helpers, which
    set the same and then warn on every command that they did: a warning no user can act on
    (RAY_AUTH_MODE=disabled still opts out)."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    from ray._raylet import AuthenticationTokenLoader, Config

    if new_cluster or AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")  # this process reads the mode from its cached Ray config


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at `address`, or the one `ray start` made on this machine. The
    address is checked first, so a dead one (or a stale record of a stopped cluster) is a
    clear error at once rather than minutes of retries."""
    if ray.is_initialized():
        return
    try:
        target = address if address not in (None, "auto") else _local_cluster_address()
    except ConnectionError as err:
        raise ClusterError(
            f"no Ray cluster running here: start one with `ray start --head` or `slotserve up` ({err})"
        ) from None
    _check_reachable(target)
    use_token_auth()
    try:
        ray.init(address=target, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as err:
        raise ClusterError(
            f"no Ray cluster running at {target}: start one with `ray start --head` or `slotserve up` ({err})"
        ) from None


def router_handle():
    try:
        return ray.get_actor(ROUTER_ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ClusterError("no slotserve router on this Ray cluster: start one with `slotserve up`") from None


def unwrap(err: BaseException) -> Exception:
    """A replica's typed error (e.g. InvalidRequestError) instead of Ray's wrapper around it. The
    wrapper of a typed error is also an instance of it (Ray subclasses both), but its message is
    the remote traceback: the error's own `cause` is what callers show."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, SlotServeError):
        return cause
    return err if isinstance(err, SlotServeError) else ClusterError(f"request failed in the cluster: {err}")


# Ray's word that an actor is dead or cannot be reached (not: the request itself failed).
ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def actor_gone(err: BaseException) -> bool:
    return isinstance(err, ACTOR_GONE)
