"""No bare tuple or string message crosses Ray: every public method of the Ray actors (the
replica, the router, the store) takes and returns protocol types, read off its type hints.

The rule, for each parameter (but `self`) and the return of every public method:

- it is annotated, and there is no `*args` or `**kwargs` (a message has named fields);
- its type is built only from: scalars (None, bool, int, float, str: an id, a name, a count, a
  time, a limit, a reason's text); classes defined in `protocol` (messages, records and typed
  errors); pydantic models (validated where they land: sampling parameters); Ray's
  `ActorHandle`; `protocol.records.JsonObject` (a JSON document: a run's config, a store row, a
  status read-out); and `list[X]`, `dict[str, X]` (a mapping from ids or names to X),
  `AsyncIterator[X]`, `X | Y` of those;
- so never a tuple (a message whose positions both ends must agree on), a bare `dict` or
  `list`, `Any` or `object`, a class of another package (a message is a protocol type), nor a
  `str` in a union with a protocol message (a string standing for a message, as "why there was
  no answer" beside a HealthReport). An exception may stand beside anything: it is the typed
  refusal of one item (`route_many`).

The rule is shown to catch a class written to break each clause, so it cannot pass by checking
nothing."""

from __future__ import annotations

import collections.abc
import inspect
import sys
import types
import typing
from typing import Annotated, Any

import pytest
from pydantic import BaseModel
from ray.actor import ActorHandle

from cluster.store_actor import StoreActor
from protocol.messages import HealthReport
from protocol.records import JSON
from replica.serving.actor import ReplicaActor
from router.actor import RouterActor

ACTORS = [ReplicaActor, RouterActor, StoreActor]
SCALARS = (type(None), bool, int, float, str)
SEQUENCES = (list, collections.abc.AsyncIterator, collections.abc.Iterator)


def _is_message(tp: object) -> bool:
    """A protocol class that is a message (not an error)."""
    return isinstance(tp, type) and tp.__module__.startswith("protocol.") and not issubclass(tp, BaseException)


def type_problem(tp: object) -> str | None:
    """Why `tp` may not cross Ray as (part of) a message, or None."""
    if typing.get_origin(tp) is Annotated:
        return None if JSON in tp.__metadata__ else type_problem(typing.get_args(tp)[0])
    if tp in SCALARS:
        return None
    if tp is Any or tp is object:
        return f"{tp!r} where a message is meant"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is tuple or origin is tuple:
        return f"a tuple ({tp!r}): a message is a protocol type with named fields"
    if origin in (typing.Union, types.UnionType):
        if str in args and any(_is_message(a) for a in args):
            return f"a str standing for a message in {tp!r}"
        return next((p for a in args if (p := type_problem(a)) is not None), None)
    if tp in (list, dict) or tp in SEQUENCES:
        return f"a bare {tp!r}"
    if origin in SEQUENCES:
        return type_problem(args[0])
    if origin is dict:
        return type_problem(args[1]) if args[0] is str else f"{tp!r}: a mapping is keyed by str ids or names"
    if isinstance(tp, type):
        if issubclass(tp, BaseException) or issubclass(tp, BaseModel) or tp is ActorHandle:
            return None
        if tp.__module__.startswith("protocol."):
            return None
        return f"{tp.__module__}.{tp.__qualname__} is not a protocol type"
    return f"{tp!r} is not a message type"


def message_problems(cls: type) -> list[str]:
    """Every breach of the rule by the public methods of `cls`."""
    problems = []
    for name, method in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_"):
            continue
        # The class's own module resolves the names: once Ray has started actors of the class, its
        # tracing wrapper stands in for each method and lives in Ray's module, not ours.
        hints = typing.get_type_hints(method, vars(sys.modules[cls.__module__]), include_extras=True)
        for param in list(inspect.signature(method).parameters.values())[1:]:
            if param.name == "_ray_trace_ctx":  # added by Ray's tracing wrapper, not ours
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                problems.append(f"{name}: *{param.name}: a message has named fields")
            elif param.name not in hints:
                problems.append(f"{name}({param.name}): not annotated")
            elif (problem := type_problem(hints[param.name])) is not None:
                problems.append(f"{name}({param.name}): {problem}")
        if "return" not in hints:
            problems.append(f"{name}: return not annotated")
        elif (problem := type_problem(hints["return"])) is not None:
            problems.append(f"{name} returns {problem}")
    return problems


@pytest.mark.parametrize("actor", ACTORS, ids=lambda a: a.__ray_actor_class__.__name__)
def test_actor_methods_take_and_return_protocol_types(actor):
    """The rule above holds on every public method of the actor (the class inside Ray's wrapper)."""
    cls = actor.__ray_actor_class__
    public = [name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")]
    assert len(public) >= 8, public  # the walk found the actor's methods
    assert message_problems(cls) == []


class _Breaks:
    """One method per clause of the rule, each breaking it."""

    def route(self, request: tuple) -> str: ...

    def route_many(self, requests: list[tuple[str, int]]) -> list[str]: ...

    def health(self) -> HealthReport | str: ...

    def info(self) -> dict: ...

    def status(self) -> dict[str, Any]: ...

    def set_run(self, *args) -> None: ...

    def submit(self, prompt, params: object) -> None: ...

    def record(self, steps: list[collections.OrderedDict[str, int]]) -> None: ...

    def sync(self) -> None:  # fine: shows the rule does not flag everything
        ...


def test_the_rule_catches_each_kind_of_untyped_message():
    """Tuples (bare or parametrised, in a list too), a str beside a message, a bare dict, Any,
    *args, a missing annotation, object, and a class that is not a protocol type are each named;
    a method within the rule is not."""
    problems = message_problems(_Breaks)
    expected = [
        "health returns a str standing for a message",
        "info returns a bare <class 'dict'>",
        "record(steps): collections.OrderedDict",
        "route(request): a tuple",
        "route_many(requests): a tuple",
        "set_run: *args",
        "status returns typing.Any where a message is meant",
        "submit(prompt): not annotated",
        "submit(params): <class 'object'> where a message is meant",
    ]
    assert len(problems) == len(expected), problems
    for want in expected:
        assert any(p.startswith(want) for p in problems), (want, problems)
    assert not any(p.startswith("sync") for p in problems)
