"""Real request traces as workloads: the Azure LLM inference CSV format and the Mooncake
JSONL format. Timing and lengths are read, and Mooncake's `hash_ids` (the prompt's blocks of
512 tokens, equal ids for equal blocks): prompts are made to the given length deterministically
(`workload.request_prompt`; with hash_ids, from those blocks, so requests that share ids share
that prefix) and outputs forced to the given length. A trace workload is named after its file.

A trace is far beyond a small machine's capacity, so `read_trace` (either format) takes a time
scale (multiply inter-arrival gaps), a length scale (multiply prompt and output lengths), a
sample (every k-th request, or the first n) and a start offset (seconds into the trace), all
kept in the workload's params so a run says how it was replayed. Bad files get a TraceError
naming the file and line.
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path
from typing import Literal

from workloads.workload import Workload, WorkloadRequest

AZURE_CONV = Path(__file__).parent / "data" / "azure_llm_2023_conv.csv"
MOONCAKE_SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"  # small, synthetic: see data/README.md
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file is malformed; the message names the file and line."""


MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the published Mooncake traces
# One request of a trace: (seconds since the trace's first request, prompt, output, line, block ids).
Row = tuple[float, int, int, int, tuple[int, ...]]


def read_trace(
    path: str | Path,
    format: Literal["azure", "mooncake"],
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    every: int = 1,
    limit: int | None = None,
    start_offset: float = 0.0,
) -> Workload:
    """A trace file in either format: its rows checked, sampled, scaled (a Mooncake block of 512
    tokens too, so a scaled prompt still spans its blocks), and arrivals rebased to 0 at the
    first request kept. Named after the file."""
    path = Path(path)
    if time_scale <= 0 or length_scale <= 0 or every < 1:
        raise TraceError(f"{path}: time_scale and length_scale must be > 0 and every >= 1")
    raw = _azure_rows(path) if format == "azure" else _mooncake_rows(path)
    previous = None
    for t, prompt, output, line, _ in raw:
        if prompt < 0 or output < 0:
            raise TraceError(f"{path}:{line}: negative length (prompt {prompt}, output {output})")
        if previous is not None and t < previous:
            raise TraceError(f"{path}:{line}: timestamp goes back in time ({t:.3f} s after {previous:.3f} s)")
        previous = t
    kept = [r for r in raw if r[0] >= start_offset][::every][:limit]
    if not kept:
        raise TraceError(f"{path}: no requests after start offset {start_offset} s")
    t0 = kept[0][0]
    block_len = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale)) if format == "mooncake" else 0
    requests = [
        WorkloadRequest(
            (t - t0) * time_scale,
            max(1, round(p * length_scale)),
            max(1, round(o * length_scale)),
            blocks=blocks,
            block_len=block_len if blocks else 0,
        )
        for t, p, o, _, blocks in kept
    ]
    params = {
        "path": path.name,
        "time_scale": time_scale,
        "length_scale": length_scale,
        "every": every,
        "limit": limit,
        "start_offset": start_offset,
    }
    if block_len:
        params["block_len"] = block_len
    return Workload(path.stem, 0, requests, params)


def read_azure_csv(path: str | Path = AZURE_CONV, **sampling: float | int | None) -> Workload:
    """The Azure LLM inference trace format: TIMESTAMP, ContextTokens, GeneratedTokens
    (`sampling`: read_trace's keywords)."""
    return read_trace(path, "azure", **sampling)


def read_mooncake_jsonl(path: str | Path, **sampling: float | int | None) -> Workload:
    """The Mooncake format: one JSON object a line with `timestamp` (ms), `input_length`,
    `output_length` and, optionally, `hash_ids` (a list of ints: the prompt's blocks of 512
    tokens, scaled with `length_scale`) (`sampling`: read_trace's keywords)."""
    return read_trace(path, "mooncake", **sampling)


def _azure_rows(path: Path) -> list[Row]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)} (found {reader.fieldnames})")
        raw, start = [], None
        for line, row in enumerate(reader, start=2):
            try:
                when = datetime.fromisoformat(row["TIMESTAMP"][:26])  # 7 decimals: keep microseconds
                prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as err:
                raise TraceError(f"{path}:{line}: {err}") from None
            start = start or when
            raw.append(((when - start).total_seconds(), prompt, output, line, ()))
    return raw


def _mooncake_rows(path: Path) -> list[Row]:
    raw = []
    with open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
                blocks = row.get("hash_ids") or []
                if not isinstance(blocks, list) or not all(isinstance(b, int) for b in blocks):
                    raise ValueError(f"hash_ids must be a list of ints, got {blocks!r}")
                raw.append(
                    (
                        float(row["timestamp"]) / 1000.0,
                        int(row["input_length"]),
                        int(row["output_length"]),
                        line,
                        tuple(blocks),
                    )
                )
            except KeyError as err:
                raise TraceError(f"{path}:{line}: missing field {err}") from None
            except (TypeError, ValueError) as err:
                raise TraceError(f"{path}:{line}: {err}") from None
    if raw:
        first = raw[0][0]
        raw = [(t - first, *rest) for t, *rest in raw]
    return raw
