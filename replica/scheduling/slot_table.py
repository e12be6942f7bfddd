"""Who holds which cache slot, and how many K/V tokens each holds against the cache's budget.

Pure bookkeeping (no torch): the scheduler asks it yes/no questions and it never decides
policy, like nano-vllm's block manager. The tensors themselves live in `kv_cache.py`.
`SlotTable` is what the scheduler asks and the half both tables share (slot ownership, the
K/V tokens in use against the budget); `TokenSlotTable` reserves K/V by the token per slot (the
slot cache), `block_manager.PagedSlotTable` by the block (the paged cache).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod

from protocol.messages import KvEvents
from replica.errors import InvariantViolation
from replica.scheduling.request import Request


class SlotTable(ABC):
    """The slots (a row of the batch each; num_slots caps concurrency), their owners, and the
    K/V tokens in use (`used_kv_tokens`, kept by each table its own way) against the budget."""

    def __init__(self, num_slots: int, max_seq_len: int, kv_budget_tokens: int | None = None):
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        # A budget below num_slots * max_seq_len models a cache smaller than every slot full.
        self.kv_budget_tokens = kv_budget_tokens or num_slots * max_seq_len
        self._free: list[int] = list(range(num_slots))  # a heap: lowest slot first keeps the batch compact
        self._owner: dict[int, Request] = {}
        self.used_kv_tokens = 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return len(self._owner)

    @property
    def free_kv_tokens(self) -> int:
        return self.kv_budget_tokens - self.used_kv_tokens

    @property
    def max_request_tokens(self) -> int:
        """The most K/V tokens one request may ever hold."""
        return min(self.max_seq_len, self.kv_budget_tokens)

    def owner(self, slot: int) -> Request | None:
        return self._owner.get(slot)

    # ---- what each table answers its own way ---------------------------------------------------
    @abstractmethod
    def cached_prefix_tokens(self, request: Request) -> int:
        """Leading tokens of `request` whose K/V admission would reuse."""

    @abstractmethod
    def shared_prefix_tokens(self, request: Request) -> int:
        """Leading tokens of an admitted request held in prefix-cache blocks, which are never
        written again (right after admission: its prefix hits)."""

    @abstractmethod
    def reset_prefix_cache(self) -> int:
        """Forget cached prefixes no request holds; how many blocks were forgotten."""

    @abstractmethod
    def take_kv_events(self) -> KvEvents | None:
        """The prefix cache's changes since the last call, for the load report being sent
        (`replica.scheduling.kv_events`); None where the table caches no prefixes."""

    @abstractmethod
    def request_kv_snapshot(self) -> bool:
        """Make the next `take_kv_events` a snapshot of the whole prefix cache (the router saw a
        gap in the batches); whether this table reports K/V events at all."""

    @abstractmethod
    def can_admit(self, request: Request, num_tokens: int) -> bool:
        """A free slot and room for the request's first `num_tokens` tokens."""

    @abstractmethod
    def admit(self, request: Request, num_tokens: int) -> None:
        """Take a slot and room for the request's first `num_tokens` tokens."""

    @abstractmethod
    def reserve(self, request: Request, total_tokens: int) -> bool:
        """Grow the request's room to `total_tokens`; False (and nothing taken) if the budget
        cannot cover it. Idempotent, so a row planned but not run does not reserve twice."""

    @abstractmethod
    def release(self, request: Request) -> None:
        """Give back the request's slot and K/V."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise InvariantViolation where the bookkeeping disagrees with itself."""

    # ---- slot ownership, shared by both tables ---------------------------------------------------
    def _take_slot(self, request: Request, num_tokens: int) -> None:
        if not self.can_admit(request, num_tokens):
            raise InvariantViolation(f"admit({request.request_id}) without a free slot or room for {num_tokens} tokens")
        slot = heapq.heappop(self._free)
        request.slot = slot
        self._owner[slot] = request

    def _free_slot(self, request: Request) -> None:
        del self._owner[request.slot]
        heapq.heappush(self._free, request.slot)
        request.slot = None

    def _check_owner(self, request: Request, action: str) -> int:
        slot = request.slot
        if slot is None or self._owner.get(slot) is not request:
            raise InvariantViolation(f"{action}() for {request.request_id}, which holds no slot")
        return slot

    def _check_reserve(self, request: Request, total_tokens: int) -> int:
        slot = self._check_owner(request, "reserve")
        if total_tokens > self.max_seq_len:
            raise InvariantViolation(f"{request.request_id} needs {total_tokens} tokens, slot holds {self.max_seq_len}")
        return slot

    def _check_slots(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise InvariantViolation(f"a slot is free twice: {sorted(self._free)}")
        if free & self._owner.keys():
            raise InvariantViolation(f"slots both free and owned: {sorted(free & self._owner.keys())}")
        if len(free) + len(self._owner) != self.num_slots:
            raise InvariantViolation(f"free {len(free)} + used {len(self._owner)} != {self.num_slots} slots")
        for slot, request in self._owner.items():
            if request.slot != slot:
                raise InvariantViolation(
                    f"slot {slot} owned by {request.request_id}, which thinks it has {request.slot}"
                )


class TokenSlotTable(SlotTable):
    """The slot cache's table: each slot reserves K/V for its owner by the token, against the
    budget, as the request grows (its row of max_seq_len tokens is set aside by the cache)."""

    def __init__(self, num_slots: int, max_seq_len: int, kv_budget_tokens: int | None = None):
        super().__init__(num_slots, max_seq_len, kv_budget_tokens)
        self._held: dict[int, int] = {}  # slot -> K/V tokens reserved for its owner

    def cached_prefix_tokens(self, request: Request) -> int:
        return 0  # slots share nothing

    def shared_prefix_tokens(self, request: Request) -> int:
        return 0

    def reset_prefix_cache(self) -> int:
        return 0

    def take_kv_events(self) -> KvEvents | None:
        return None

    def request_kv_snapshot(self) -> bool:
        return False

    def can_admit(self, request: Request, num_tokens: int) -> bool:
        return bool(self._free) and num_tokens <= self.free_kv_tokens

    def admit(self, request: Request, num_tokens: int) -> None:
        self._take_slot(request, num_tokens)
        self._held[request.slot] = 0
        self.reserve(request, num_tokens)

    def reserve(self, request: Request, total_tokens: int) -> bool:
        slot = self._check_reserve(request, total_tokens)
        need = total_tokens - self._held[slot]
        if need <= 0:
            return True
        if need > self.free_kv_tokens:
            return False
        self._held[slot] += need
        self.used_kv_tokens += need
        return True

    def release(self, request: Request) -> None:
        self._check_owner(request, "release")
        self.used_kv_tokens -= self._held.pop(request.slot)
        self._free_slot(request)

    def check_invariants(self) -> None:
        self._check_slots()
        if sum(self._held.values()) != self.used_kv_tokens or self.used_kv_tokens > self.kv_budget_tokens:
            raise InvariantViolation(
                f"K/V tokens held {sum(self._held.values())}, counted {self.used_kv_tokens}, "
                f"budget {self.kv_budget_tokens}"
            )
