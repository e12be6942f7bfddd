"""Trace readers: the shipped Azure conversation trace and the Mooncake format become
workloads with the stated scaling, and malformed files get an error naming file and line."""

from __future__ import annotations

import json

import pytest

from workloads.traces import AZURE_CONV, TraceError, read_azure_csv, read_mooncake_jsonl


def test_shipped_azure_trace_reads_whole():
    """19,366 requests over about an hour, arrivals from 0 and never decreasing."""
    w = read_azure_csv()
    assert len(w.requests) == 19366
    arrivals = [r.arrival for r in w.requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and 3000 < arrivals[-1] < 4000
    assert (w.requests[0].prompt_len, w.requests[0].output_len) == (374, 44)  # the file's first row


def test_scaling_sampling_and_offset_are_applied_and_recorded():
    """time_scale stretches gaps, length_scale shrinks lengths, every/limit sample, and the
    offset skips into the trace; all are kept in params."""
    full = read_azure_csv()
    w = read_azure_csv(time_scale=2.0, length_scale=0.1, every=10, limit=50, start_offset=60.0)
    kept = [r for r in full.requests if r.arrival >= 60.0][::10][:50]
    assert len(w.requests) == 50
    assert w.requests[1].arrival == pytest.approx(2 * (kept[1].arrival - kept[0].arrival))
    assert w.requests[3].prompt_len == max(1, round(kept[3].prompt_len * 0.1))
    assert w.params["time_scale"] == 2.0 and w.params["every"] == 10 and w.params["start_offset"] == 60.0


@pytest.mark.parametrize(
    "body, message",
    [
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n", ":1: missing column(s) GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-3,44\n", ":2: negative length"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,3,4\n2023-11-16 18:15:40.0,3,4\n",
            ":3: timestamp goes back in time",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", ":2:"),
    ],
)
def test_bad_azure_files_name_file_and_line(tmp_path, body, message):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(TraceError, match="bad.csv" + message.replace("(", r"\(").replace(")", r"\)")):
        read_azure_csv(path)


def test_mooncake_jsonl(tmp_path):
    """timestamp in ms, lengths as given; a missing field names the line."""
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 100, "output_length": 10, "hash_ids": [1]},
        {"timestamp": 1500, "input_length": 200, "output_length": 20, "hash_ids": [1, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = read_mooncake_jsonl(path, time_scale=4.0)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in w.requests] == [(0.0, 100, 10), (2.0, 200, 20)]
    path.write_text(json.dumps({"timestamp": 1, "input_length": 2}) + "\n")
    with pytest.raises(TraceError, match=r"trace.jsonl:1: missing field 'output_length'"):
        read_mooncake_jsonl(path)


def test_license_note_ships_with_the_trace():
    note = (AZURE_CONV.parent / "README.md").read_text()
    assert "CC-BY 4.0" in note and "Splitwise" in note
