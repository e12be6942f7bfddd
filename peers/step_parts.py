"""Where one engine step's time goes, by part: matrix products, attention, the per-layer C++
kernels, the rest of the forward pass, step metadata, sampling, the scheduler and the engine's
bookkeeping. The one measurement behind `slotserve bench`'s host-overhead figures and
`benchmarks/step_profile.py`'s breakdown.

Why wrappers and not torch's profiler: the C++ kernels are not torch operators (the profiler
does not see them) and the Python around the forward pass (scheduler, metadata, sampling) is
what the host share is about. Each part's callables are wrapped for the steps measured and
unwrapped after; the wrappers' own cost, measured at the start, is taken off the part that
made the calls, so the figures are about those of the unwrapped step (a wrapper's cost that
falls inside the part it wraps stays there: host time reads a little low).
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator

from replica.engine import Engine
from replica.kernels import fused_ops
from replica.model import decoder
from replica.model.linear import Linear

# The step's parts, in the order printed. Forward-pass parts nest inside "forward"; what is left
# of it ("forward, other") is the embedding, the final norm's gather and the loop's own Python.
FORWARD_PARTS = ("matrix products", "attention", "C++ kernels")
PARTS = (*FORWARD_PARTS, "forward, other", "metadata", "sampling", "scheduler", "engine")
# The part a wrapped call's own cost lands in, by the wrapped part it was made from.
_CHARGED_TO = {"forward": "forward, other", "execute": "metadata", "step": "engine"}


class Parts:
    """Seconds and torch operators per part of a step, gathered by wrapping the callables that
    make up a step (see `wrapped`); nested parts are subtracted from their parent when read."""

    def __init__(self, wrapper_seconds: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> None:
        """clock: wall time by default; `time.thread_time` counts the calling thread's CPU time
        only, which a neighbour's load on a shared machine does not stretch as it does wall time."""
        self.clock = clock
        self.seconds: collections.Counter[str] = collections.Counter()
        self.ops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.calls: collections.Counter[str] = collections.Counter()  # wrapped calls, by the part making them
        self.wrapper_seconds = wrapper_seconds
        self.stack = ["engine"]

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.calls[self.stack[-1]] += 1
            self.stack.append(part)
            t = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += self.clock() - t
                self.stack.pop()

        return timed

    def step_seconds(self, steps: int) -> dict[str, float]:
        """Per step, each part exclusive of the parts nested in it and of the wrappers' cost;
        "host" is the step less its matrix products and attention."""
        s = self.seconds
        flat = {p: s[p] for p in FORWARD_PARTS} | {
            "forward, other": s["forward"] - sum(s[p] for p in FORWARD_PARTS),
            "metadata": s["execute"] - s["forward"] - s["sampling"],
            "sampling": s["sampling"],
            "scheduler": s["scheduler"],
            "engine": s["step"] - s["execute"] - s["scheduler"],
        }
        overhead = 0.0
        for caller, n in self.calls.items():
            if caller != "engine":  # the step's own wrapper: outside the step it times
                flat[_CHARGED_TO.get(caller, caller)] -= n * self.wrapper_seconds
                overhead += n * self.wrapper_seconds
        step = s["step"] - overhead
        per = {p: v / steps for p, v in flat.items()} | {"step": step / steps}
        return per | {"host": per["step"] - per["matrix products"] - per["attention"]}


def wrapper_seconds(calls: int = 20_000, clock: Callable[[], float] = time.perf_counter) -> float:
    """The cost a wrapper adds to one call (the best of three timings, each less the bare calls),
    on `clock` (see `Parts`)."""

    def bare() -> None:
        return None

    parts = Parts(clock=clock)
    timed = parts.wrap("probe", bare)
    best = float("inf")
    for _ in range(3):
        t = clock()
        for _ in range(calls):
            timed()
        wrapped_s = clock() - t
        t = clock()
        for _ in range(calls):
            bare()
        best = min(best, (wrapped_s - (clock() - t)) / calls)
    return max(0.0, best)


@contextlib.contextmanager
def wrapped(engine: Engine, parts: Parts) -> Iterator[Callable[[], object]]:
    """Wraps the step's phases on this engine and the forward pass's calls (module-wide, undone
    on exit); yields the wrapped step."""
    runner = engine.runner
    patches = [
        (engine.scheduler, "schedule", "scheduler"),
        (engine.scheduler, "advance", "scheduler"),
        (runner, "execute", "execute"),
        (runner.model, "forward", "forward"),
        (runner.sampler, "sample", "sampling"),
        (Linear, "__call__", "matrix products"),
        (decoder, "slot_attention", "attention"),
        (decoder, "paged_attention", "attention"),
        *((fused_ops, name, "C++ kernels") for name in ("rope_write", "silu_mul", "rms_norm")),
    ]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
    for obj, name, part in patches:
        setattr(obj, name, parts.wrap(part, getattr(obj, name)))
    try:
        yield parts.wrap("step", engine.step)
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)  # an instance's bound method: the class's shows through again
            else:
                setattr(obj, name, old)


def decode_max_tokens(steps: int) -> int:
    """The `max_tokens` that keeps a request decoding through `steps` measured decode steps after
    its prefill step: the prefill samples the first token and each step one more, so with
    `steps + 1` the last step measured would also finish every request (freeing its slot and
    detokenizing its end), host work no other decode step does. One more token keeps every
    measured step a plain decode, as `benchmarks/step_profile.py`'s engines are."""
    return steps + 2


def measure(
    engines: Iterator[Engine], steps: int, wrapper_s: float, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Seconds per step by part (and "step", "host") over `steps` steps, each the next step of
    `next(engines)` (one engine stepped on for decodes, a fresh one per prefill); `wrapper_s`
    measured on the same `clock`."""
    parts = Parts(wrapper_s, clock)
    for _ in range(steps):
        with wrapped(next(engines), parts) as step:
            step()
    return parts.step_seconds(steps)
