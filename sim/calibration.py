"""`slotserve calibrate`: measure the real engine's step times on this machine and fit the
simulator's cost model to them (`replica.model.fake.FittedCostModel`).

The real engine (`Engine` with the real `ModelRunner`, on the wall clock) runs a designed
grid of synthetic requests, each cell in a fresh engine on one shared runner:

- `mixed` cells, B requests with L-token prompts: one step prefills B x L tokens, the next
  ones decode at batch B with context about L, for B = 1, 2, 4, ... up to the slots and a
  short, a middle and a long L: decode batch size against context length;
- `chunked` cells with a small token budget: prefill chunks of a set size at growing start
  positions, sharing steps with decodes (the mixed steps of chunked prefill);
- a `static` cell with spread output lengths: padding rows of finished requests.

With `--replicas N` the grid runs in N processes at once, one model each: the step times of a
replica that shares this machine with N-1 busy neighbours (memory bandwidth and caches are
shared), which is what a simulated N-replica cluster on this machine should pay. A process
that finishes early keeps stepping, unrecorded, until the last one is done, so every recorded
step ran beside N-1 others.

Each step's record duration (what the simulator's steps last) is paired with the features
the scheduler gave that step (`StepFeatures`), and a non-negative least-squares fit gives
the coefficients; every fifth step is held out to measure the fit. The first cell only warms
the runner up (allocations, caches) and is not used. Torch runs 1 thread by default, as a
cluster replica does at its default Ray `num_cpus=1` (and a busy neighbour then disturbs the
measurement far less than it disturbs threads that wait on each other).

With `--from-store DB --runs ID...` nothing is measured: the fit is made to the steps real
runs recorded (`steps` rows: decode, prefill and context tokens, padding rows, duration), so a
cluster's own serving steps, with whatever else shared the machine with it, calibrate it.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from queue import Empty

from tqdm import tqdm

from protocol.clock import Clock
from protocol.cpu import UNKNOWN_CPU, cpu_info
from replica.config import EngineConfig
from replica.engine import Engine, Runner
from replica.errors import ConfigError
from replica.model.loader import DEFAULT_MODEL
from replica.scheduling.scheduler import SchedulerOutput
from sim.cost_model import FEATURES, FittedCostModel, StepFeatures

DEFAULT_OUT = Path("results/cost_model.json")


@dataclass(frozen=True)
class ProbeCell:
    """`batch` requests with `prompt_len`-token prompts and `max_tokens` outputs (spread over
    1..max_tokens when `spread`) through a fresh engine of `policy`."""

    policy: str
    batch: int
    prompt_len: int
    max_tokens: int
    token_budget: int = 256
    spread: bool = False

    @property
    def label(self) -> str:
        budget = f" budget {self.token_budget}" if self.policy == "chunked" else ""
        return f"{self.policy} B={self.batch} L={self.prompt_len}{budget}"


def grid(num_slots: int, quick: bool) -> list[ProbeCell]:
    """The cells, the warm-up first. --quick keeps fewer context lengths and shorter decodes."""
    batches = sorted({1, *(b for b in (2, 4, 8, 16, 32, 64) if b <= num_slots), num_slots})
    lengths, decode = ((16, 192), 6) if quick else ((16, 128, 384), 10)
    cells = [ProbeCell("mixed", 1, 8, 3)]
    cells += [ProbeCell("mixed", b, length, decode + 1) for length in lengths for b in batches]
    cells += [
        ProbeCell("chunked", num_slots, 64 if quick else 128, 3, token_budget=budget)
        for budget in ((32,) if quick else (32, 96))
    ]
    cells.append(ProbeCell("static", num_slots, 32, decode + 2, spread=True))
    return cells


class FeatureTap:
    """The runner, passed through, noting each step's features: the engine's StepRecord says
    how long a step took but not how much context it attended."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.features: list[StepFeatures] = []

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, out: SchedulerOutput) -> list[int]:
        self.features.append(StepFeatures.of(out))
        return self.runner.execute(out)


def run_cell(
    tap: FeatureTap, cell: ProbeCell, max_seq_len: int, seed: int, clock: Clock | None = None
) -> list[tuple[StepFeatures, float, str]]:
    """(features, seconds, kind) of every step of one cell, run to completion."""
    config = EngineConfig(
        policy=cell.policy, num_slots=cell.batch, max_seq_len=max_seq_len, token_budget=cell.token_budget
    )
    engine = Engine(config, tap, clock)
    for i in range(cell.batch):
        prompt = [100 + (seed * 7919 + 31 * i + 7 * j) % 20000 for j in range(cell.prompt_len)]
        n = 1 + i % cell.max_tokens if cell.spread else cell.max_tokens
        engine.add_request(prompt, {"max_tokens": n, "ignore_eos": True})
    engine.scheduler.close_arrivals()
    samples = []
    while engine.has_unfinished:
        record = engine.step().record
        if record is None:
            engine.wait_idle()
            continue
        samples.append((tap.features[-1], record.duration, _kind(tap.features[-1])))
    return samples


def _kind(f: StepFeatures) -> str:
    if f.padding_rows:
        return "padded"
    if f.prefill_tokens and f.decode_tokens:
        return "mixed"
    return "prefill" if f.prefill_tokens else f"decode B={f.decode_tokens}"


def calibration_machine(model: str, dtype: str, device: str, num_slots: int, replicas: int = 1) -> dict:
    """What the coefficients belong to: the CPU, its cores, torch and its threads, the model,
    and how many replicas were measured side by side."""
    import torch

    cpu = cpu_info().model
    return {
        "cpu": cpu if cpu != UNKNOWN_CPU else platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": model,
        "dtype": dtype,
        "device": device,
        "num_slots": num_slots,
        "replicas": replicas,
        "hostname": platform.node(),
        "calibrated": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def calibrate(
    model: str = DEFAULT_MODEL,
    num_slots: int = 8,
    dtype: str = "float32",
    device: str = "auto",
    quick: bool = False,
    seed: int = 0,
    progress: bool = True,
    replicas: int = 1,
) -> tuple[FittedCostModel, list[tuple[StepFeatures, float, str]]]:
    """Measure the grid (in `replicas` processes at once when more than one, each on as many
    torch threads as this process has) and fit; returns the model and the samples it was
    fitted on."""
    import torch

    from replica.model.runner import ModelRunner

    cells = grid(num_slots, quick)
    max_seq_len = max(c.prompt_len + c.max_tokens for c in cells)
    if replicas == 1:
        runner = ModelRunner(
            EngineConfig(
                model=model, num_slots=num_slots, max_seq_len=max_seq_len, dtype=dtype, device=device, seed=seed
            )
        )
        samples, device = measure(runner, cells, max_seq_len, seed, progress), runner.device
    else:
        ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
        barrier, finished, queue = ctx.Barrier(replicas), ctx.Value("i", 0), ctx.Queue()
        workers = [
            ctx.Process(
                target=_colocated_replica,
                daemon=True,
                args=(
                    i,
                    barrier,
                    finished,
                    queue,
                    model,
                    num_slots,
                    max_seq_len,
                    dtype,
                    device,
                    seed + i,
                    torch.get_num_threads(),
                    cells,
                    progress and i == 0,
                ),
            )
            for i in range(replicas)
        ]
        for w in workers:
            w.start()
        results = []
        while len(results) < replicas:
            try:
                results.append(queue.get(timeout=1.0))
            except Empty:
                dead = [(i, w.exitcode) for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
                if dead:  # the others would wait for it forever
                    for w in workers:
                        w.terminate()
                    raise RuntimeError(
                        f"calibration process {dead[0][0]} of {replicas} died (exit code "
                        f"{dead[0][1]}); its error is printed above"
                    ) from None
        for w in workers:
            w.join()
        samples = [s for _, _, measured in sorted(results, key=lambda r: r[0]) for s in measured]
        device = results[0][1]
    return fit(samples, calibration_machine(model, dtype, device, num_slots, replicas)), samples


def fit(samples: list[tuple[StepFeatures, float, str]], ran_on: dict) -> FittedCostModel:
    """The cost model fitted to (features, seconds, kind) samples, saved with where they ran."""
    return FittedCostModel.fit([(f, t) for f, t, _ in samples], machine=ran_on)


def calibrate_from_store(
    store_path: Path, run_ids: list[int]
) -> tuple[FittedCostModel, list[tuple[StepFeatures, float, str]]]:
    """The cost model fitted to the recorded steps of real runs, and those samples."""
    samples, ran_on = samples_from_store(store_path, run_ids)
    return fit(samples, ran_on), samples


def _colocated_replica(
    index: int,
    barrier,
    finished,
    queue,
    model: str,
    num_slots: int,
    max_seq_len: int,
    dtype: str,
    device: str,
    seed: int,
    threads: int,
    cells: list[ProbeCell],
    progress: bool,
) -> None:
    """One of `calibrate(replicas=N)`'s processes: load, wait for the others, measure the grid,
    then keep the machine as busy as a serving neighbour until every process has measured."""
    import torch

    from replica.model.runner import ModelRunner

    torch.set_num_threads(threads)
    runner = ModelRunner(
        EngineConfig(model=model, num_slots=num_slots, max_seq_len=max_seq_len, dtype=dtype, device=device, seed=seed)
    )
    barrier.wait()
    samples = measure(runner, cells, max_seq_len, seed, progress)
    queue.put((index, runner.device, samples))
    with finished.get_lock():
        finished.value += 1
    tap = FeatureTap(runner)
    while finished.value < barrier.parties:
        run_cell(tap, cells[-1], max_seq_len, seed)


def measure(
    runner: Runner,
    cells: list[ProbeCell],
    max_seq_len: int,
    seed: int = 0,
    progress: bool = False,
    clock: Clock | None = None,
) -> list[tuple[StepFeatures, float, str]]:
    """Every step of every cell but the first (the warm-up), timed on `clock` (default: the
    wall clock; tests pass a fake runner's FakeClock)."""
    tap = FeatureTap(runner)
    samples = []
    bar = tqdm(cells, desc="calibrate", unit="cell", disable=not progress)
    for n, cell in enumerate(bar):
        bar.set_postfix_str(cell.label)
        measured = run_cell(tap, cell, max_seq_len, seed, clock)
        if n > 0:
            samples += measured
    return samples


def samples_from_store(store_path: Path, run_ids: list[int]) -> tuple[list[tuple[StepFeatures, float, str]], dict]:
    """The steps of real recorded runs as samples, and the machine they ran on (the first
    run's, with what ran: model, dtype, threads, replicas, and which runs)."""
    from metrics.store import MetricsStore

    if not run_ids:
        raise ConfigError("--from-store needs --runs: the ids of the real runs to fit to")
    if not Path(store_path).is_file():
        raise ConfigError(f"no metrics store at {store_path}")
    store = MetricsStore(store_path)
    try:
        samples, runs = [], [store.run(run_id) for run_id in run_ids]
        for run in runs:
            if run["simulated"]:
                raise ConfigError(
                    f"run {run['run_id']} of {store_path} is simulated: a cost model is fitted to real step times"
                )
            rows = store.steps(run["run_id"])
            if not rows or any(r["context_tokens"] is None or r["duration"] is None for r in rows):
                raise ConfigError(
                    f"run {run['run_id']} of {store_path} has no steps with context tokens recorded "
                    "(runs stored before slotserve recorded them cannot calibrate)"
                )
            samples += [(f, r["duration"], _kind(f)) for r in rows for f in [StepFeatures.of_row(r)]]
    finally:
        store.close()
    config = runs[0]["config"]
    engine = config.get("engine") or config.get("replica", {}).get("engine", {})
    cluster = config.get("cluster") or {}  # an experiment cell's runs: what ran is its cluster
    machine = {
        **(runs[0]["machine"] or {}),
        "model": engine.get("model", cluster.get("model")),
        "dtype": engine.get("dtype", cluster.get("dtype")),
        "device": engine.get("device", cluster.get("device")),
        "num_slots": engine.get("num_slots", cluster.get("slots")),
        "threads": config.get("torch_threads", config.get("num_cpus_per_replica", cluster.get("num_cpus"))),
        "replicas": config.get("num_replicas", 1),
        "calibrated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "fitted_to": f"{store_path} runs {', '.join(map(str, run_ids))}",
    }
    return samples, machine


def format_fit(model: FittedCostModel, samples: list[tuple[StepFeatures, float, str]]) -> str:
    """The coefficients, the fit quality, and measured against predicted per kind of step."""
    q, m = model.quality, model.machine
    units = {
        "c0": ("per step", 1e3, "ms"),
        "c_decode": ("per decode token", 1e3, "ms"),
        "c_prefill": ("per prefill token", 1e3, "ms"),
        "c_ctx": ("per attended context token", 1e6, "us"),
        "c_held": ("per padding row", 1e3, "ms"),
    }
    lines = [
        f"cost model for {m.get('model')} ({m.get('dtype')}, {m.get('device')}) on {m.get('cpu', m.get('processor'))}, "
        f"{m.get('threads')} torch threads, {m.get('replicas', 1)} replica(s) side by side",
        f"step_time = c0 + c_decode*decode + c_prefill*prefill + c_ctx*context + c_held*padding  "
        f"(features: {', '.join(FEATURES)})",
    ]
    lines += [
        f"  {name:<10}{getattr(model, name) * scale:>10.4f} {unit:<3} {what}"
        for name, (what, scale, unit) in units.items()
    ]
    lines.append(
        f"fit on {q.num_fit} steps; held out {q.num_heldout}: R^2 {q.r2:.3f}, median relative error "
        f"{100 * q.median_rel_error:.1f}%"
    )
    groups: dict[str, list[tuple[StepFeatures, float]]] = defaultdict(list)
    for f, t, kind in samples:
        groups[kind].append((f, t))
    lines.append(f"  {'step kind':<14}{'steps':>6}{'measured ms':>13}{'predicted ms':>14}")
    for kind in sorted(groups, key=lambda k: (k.split(" ")[0], int(k.split("=")[1]) if "=" in k else 0)):
        rows = groups[kind]
        lines.append(
            f"  {kind:<14}{len(rows):>6}{1e3 * statistics.median(t for _, t in rows):>13.1f}"
            f"{1e3 * statistics.median(model.predict(f) for f, _ in rows):>14.1f}"
        )
    return "\n".join(lines)
