"""The `slotserve` command line: generate prints what the engine made, errors are clear
one-liners with a non-zero exit, and compare prints its table and writes its files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli.main import main
from replica import Engine, EngineConfig


def test_generate_json_matches_engine(tiny_gpt2_dir, capsys):
    """--json prints one object per prompt with the engine's own greedy tokens and text."""
    assert (
        main(
            [
                "generate",
                "Hello there",
                "The sky is",
                "--model",
                tiny_gpt2_dir,
                "--max-tokens",
                "5",
                "--json",
                "--local",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    engine = Engine(EngineConfig(model=tiny_gpt2_dir, max_seq_len=1024))
    expected = engine.generate(["Hello there", "The sky is"], {"max_tokens": 5})
    assert [line["prompt"] for line in lines] == ["Hello there", "The sky is"]
    assert [line["token_ids"] for line in lines] == [c.token_ids for c in expected]
    assert [line["text"] for line in lines] == [c.text for c in expected]
    assert all(line["finish_reason"] in ("length", "eos") for line in lines)


def test_generate_chat_applies_template(tiny_gpt2_dir, capsys):
    """--chat wraps the prompt in the chat template, so more prompt tokens reach the model."""
    main(["generate", "Hi", "--model", tiny_gpt2_dir, "--max-tokens", "2", "--json", "--local"])
    plain = json.loads(capsys.readouterr().out)
    main(["generate", "Hi", "--model", tiny_gpt2_dir, "--max-tokens", "2", "--json", "--chat", "--local"])
    chat = json.loads(capsys.readouterr().out)
    assert chat["num_prompt_tokens"] > plain["num_prompt_tokens"] + 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--model", "/nonexistent/model"], "neither a built-in"),
    ],
)
def test_generate_bad_input_is_a_clear_error(tiny_gpt2_dir, capsys, args, message):
    """Bad values end with exit code 2 and a one-line error naming the field, not a traceback."""
    model = [] if "--model" in args else ["--model", tiny_gpt2_dir]
    assert main(["generate", "Hi", "--local", *model, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unknown_policy_is_rejected_by_the_parser():
    """An unknown --policy is refused with the list of choices (argparse exit code 2)."""
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "generate", "x", "--policy", "fifo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "invalid choice: 'fifo'" in proc.stderr and "chunked" in proc.stderr


def test_compare_prints_table_and_writes_outputs(tiny_gpt2_dir, tmp_path, capsys):
    """compare replays one workload through the chosen policies and writes traces, steps,
    summary and a plot; the chunked row respects the stated budget."""
    code = main(
        [
            "compare",
            "--model",
            tiny_gpt2_dir,
            "--policies",
            "continuous",
            "chunked",
            "--requests",
            "8",
            "--max-seq-len",
            "600",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "continuous" in out and "chunked" in out and "token budget 64" in out
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["policy"] for r in summary["rows"]] == ["continuous", "chunked"]
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 16 and all(t["finish_reason"] == "length" for t in traces)
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    chunked = [s for s in steps if s["policy"] == "chunked"]
    assert max(s["num_decode_tokens"] + s["num_prefill_tokens"] for s in chunked) <= 64
    assert (run_dir / "policies.png").stat().st_size > 10_000
