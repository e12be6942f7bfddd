"""Named choices (batching policies, routing policies, workloads, cost models) behind one
lookup, so every "unknown X" error reads the same and lists what is allowed."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Generic, TypeVar

from protocol.errors import SlotServeError

T = TypeVar("T")


class UnknownChoiceError(SlotServeError, ValueError):
    """A name that is not one of the registered choices; the message lists them."""

    def __init__(self, kind: str, name: object, choices: list[str]):
        self.kind, self.name, self.choices = kind, name, choices
        super().__init__(f"unknown {kind} {name!r}; choose one of {', '.join(choices)}")

    def __reduce__(self):  # so the error crosses process boundaries (Ray) intact
        return type(self), (self.kind, self.name, self.choices)


class Registry(Mapping[str, T], Generic[T]):
    """A read-only name -> item mapping whose lookup failure is an UnknownChoiceError naming
    `kind` ("batching policy", "routing policy", ...) and every valid name, in order."""

    def __init__(self, kind: str, items: Mapping[str, T]):
        self.kind = kind
        self._items = dict(items)

    @classmethod
    def of_named(cls, kind: str, items: Iterable[T]) -> Registry[T]:
        """Items that carry their own `name` (the policy classes), under it, in the order given."""
        return cls(kind, {item.name: item for item in items})

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise UnknownChoiceError(self.kind, name, list(self._items)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def check(self, name: str) -> str:
        """`name` itself when registered, else the UnknownChoiceError (for validators)."""
        self[name]
        return name
