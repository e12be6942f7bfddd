"""The `slotserve` command line: generate prints what the engine made, errors are clear
one-liners with a non-zero exit, and compare prints its table and writes its files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import build_parser, main
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


def test_left_out_flags_and_keys_build_the_default_engine(capsys):
    """`slotserve up` without engine or bound flags builds the replica and router bounds the
    config models build by default, an experiment file's cluster without those keys asks for the
    same engine, and --help shows those defaults (one defaults table, `protocol.defaults`)."""
    from cli.common import cluster_spec
    from cluster.deploy import ClusterSpec
    from workloads.experiment import ClusterSection

    spec = cluster_spec(build_parser().parse_args(["up"]))
    default = EngineConfig()
    assert spec.replica.engine == default
    assert spec.replica.max_queue == ClusterSpec().replica.max_queue
    assert spec.max_in_flight_per_replica == ClusterSpec().max_in_flight_per_replica
    section = ClusterSection(model="fake", fake_step_seconds=0.1)
    assert (section.slots, section.max_seq_len, section.token_budget, section.dtype) == (
        default.num_slots,
        default.max_seq_len,
        default.token_budget,
        default.dtype,
    )
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    shown = " ".join(capsys.readouterr().out.split()).split("options:", 1)[1]
    for flag, value in (
        ("--max-seq-len", default.max_seq_len),
        ("--dtype", default.dtype),
        ("--slots", default.num_slots),
    ):
        assert f"(default: {value})" in shown.split(f"{flag} ", 1)[1].split(" --", 1)[0], flag


def test_up_with_pools_prices_hand_overs_on_the_link_it_is_given():
    """`slotserve up` with pools prices the queue-aware decider's hand-overs on --kv-link, the
    same links an experiment's `kv_link` names (same-node unless told)."""
    from cli.common import cluster_spec
    from cli.up import disaggregated
    from protocol.handover import CROSS_NODE, SAME_NODE

    def link(*flags: str):
        args = build_parser().parse_args(["up", "--prefill-replicas", "1", "--decode-replicas", "1", *flags])
        return disaggregated(cluster_spec(args), args).pd_pools().link

    assert (link(), link("--kv-link", "cross_node")) == (SAME_NODE, CROSS_NODE)


def test_compare_prints_table_and_writes_outputs(tiny_gpt2_dir, tmp_path, capsys):
    """compare replays one workload through the chosen policies and writes traces, steps,
    summary and a plot: each row's throughput is its requests' tokens over their makespan and
    is what the table prints; continuous batching computes no row it throws away; the chunked
    policy keeps every step within its default budget of 64 tokens."""
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
    table = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 16 and all(t["finish_reason"] == "length" for t in traces)
    for row in summary["rows"]:
        mine = [t for t in traces if t["policy"] == row["policy"]]
        makespan = max(t["finish_time"] for t in mine) - min(t["arrival"] for t in mine)
        assert len(mine) == 8
        assert row["throughput"] == pytest.approx(sum(len(t["token_times"]) for t in mine) / makespan)
        assert table[row["policy"]][1] == f"{row['throughput']:.1f}"
    assert {r["policy"]: r["slot_efficiency"] for r in summary["rows"]}["continuous"] == 1.0
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    chunked = [s for s in steps if s["policy"] == "chunked"]
    assert max(s["num_decode_tokens"] + s["num_prefill_tokens"] for s in chunked) <= 64
    assert (run_dir / "policies.png").stat().st_size > 10_000


def _commands(parser, prefix: str = "slotserve"):
    """Every (command line, parser) under `parser`, nested commands (dashboard push) included."""
    import argparse

    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prefix} {name}")


def test_every_option_shows_its_default_in_help():
    """`--help` of every command: each option has help, and each with a default (not None, a
    flag's on/off, or an empty list) shows its value (one read from an environment variable
    names the variable instead); `up` and `serve` show --replicas, --slots,
    --port and --max-seq-len with their values."""
    checked = 0
    for command, parser in _commands(build_parser()):
        # argparse wraps help to the terminal and breaks a word longer than a line (a default path
        # inside a deep checkout), so the defaults are looked for with every space taken out.
        text = "".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"{command} {action.option_strings[0]} has no help"
            default = action.default
            if default is None or isinstance(default, bool) or default == []:
                continue
            shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
            assert "".join(f"(default: {shown})".split()) in text or "(default: $" in action.help, (
                command,
                action.option_strings[0],
            )
            checked += 1
    assert checked > 80
    for command, options in (("up", ("--replicas", "--slots", "--max-seq-len")), ("serve", ("--port",))):
        parser = next(p for c, p in _commands(build_parser()) if c == f"slotserve {command}")
        text = " ".join(parser.format_help().split())
        for option in options:
            assert re.search(rf"{option} \S+ .*?\(default: \S+\)", text), (command, option)


def test_generate_help_says_where_it_runs_and_what_temperature_defaults_to():
    """generate's help: through the cluster when one is up, in-process with --local; its
    temperature default is 0 (greedy) and over HTTP it is 1.0."""
    text = " ".join(next(p for c, p in _commands(build_parser()) if c == "slotserve generate").format_help().split())
    assert "through its router to its replicas" in text and "--local" in text
    assert "0 = greedy" in text and "over HTTP the default is 1.0" in text and "(default: 0.0)" in text


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the two tests that start a cluster on it (each stops its own)."""
    import ray

    ray.init(address="local", num_cpus=3, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_generate_chat_through_the_cluster_and_up_refuses_a_second_cluster(tiny_gpt2_dir, capsys, local_ray):
    """On a running cluster of the tiny model, `generate --chat` applies the model's chat
    template in the CLI and gets the same greedy tokens as `--local --chat`; `up` against it
    says a cluster is running before it starts anything."""

    from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
    from replica.serving.loop import ReplicaConfig

    args = ["generate", "Hi", "--model", tiny_gpt2_dir, "--max-tokens", "4", "--json", "--chat"]
    assert main([*args, "--local"]) == 0
    local = json.loads(capsys.readouterr().out)
    try:
        replica = ReplicaConfig(engine=EngineConfig(model=tiny_gpt2_dir, max_seq_len=256))
        start_cluster(ClusterSpec(num_replicas=1, replica=replica))
        assert main(args) == 0
        remote = json.loads(capsys.readouterr().out)
        assert remote["replica"] == "replica-0" and remote["token_ids"] == local["token_ids"]
        assert main(["up", "--fake-step", "0.01"]) == 2
        out, err = capsys.readouterr()
        assert "starting" not in out and "already running" in err
    finally:
        stop_cluster()


def test_run_announces_its_probe_and_ends_with_the_store(tmp_path, capsys, local_ray):
    """`slotserve run` on a cluster it starts: one line says what the capacity probe does before
    it runs (and that it is not recorded), its requests go on the progress bar, the measured
    capacity is printed, and the last line names the store the runs were recorded in."""

    store = tmp_path / "runs.db"
    code = main(
        ["run", "--fake-step", "0.01", "--replicas", "2", "--slots", "2", "--max-seq-len", "320"]
        + ["--requests", "6", "--workload", "saturated", "--store", str(store)]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.strip().splitlines()
    probe = next(i for i, line in enumerate(lines) if line.startswith("measuring the cluster's capacity"))
    assert "3 decode probes of 4 requests" in lines[probe] and "not recorded" in lines[probe]
    assert re.search(r"capacity probe: 100%.* 36/36", err)  # 3 x (4 decode + 8 prefill) requests
    assert any(line.startswith("capacity: ") and " s)" in line for line in lines[probe + 1 :])
    assert lines[-1].startswith("recorded runs ") and f"in {store.resolve()}" in lines[-1]


def test_verdict_names_the_winner_and_whether_it_holds_across_seeds():
    """The closing line of `slotserve run`: the winner on goodput and on TTFT p99 (best median),
    by how much over the runner-up, and 'holds' only when its worst seed beats every other
    policy's best; otherwise it names the policies within reach, even one that is not the
    runner-up by median."""
    from metrics.verdict import verdict_line, verdict_table

    def run(seed: int, goodput: float, p99: float) -> dict:
        return {"seed": seed, "cluster": {"goodput": goodput, "ttft": {"p99": p99}}}

    by_policy = {
        "precise_prefix": [run(0, 130, 0.5), run(1, 120, 0.9), run(2, 125, 0.6)],
        "round_robin": [run(0, 100, 1.0), run(1, 110, 1.1), run(2, 105, 1.2)],
        "power_of_two": [run(0, 60, 0.8), run(1, 115, 2.0), run(2, 70, 3.0)],  # one good seed, poor median
    }
    line = verdict_line(by_policy)
    assert "goodput (tok/s): precise_prefix 125 vs round_robin 105, 1.19x higher" in line
    assert "holds: its worst of 3 seeds (0, 1, 2) beats every other policy's best" in line
    assert "TTFT p99 (s): precise_prefix 0.6 vs round_robin 1.1, 1.83x lower" in line
    assert line.endswith("within noise: power_of_two reached its worst of 3 seeds (0, 1, 2))")
    table = verdict_table(by_policy).splitlines()
    assert table[1].startswith("precise_prefix") and table[1].endswith("3 (0, 1, 2)")
    same_seed = {p: [{**a, "seed": 0} for a in runs] for p, runs in by_policy.items()}
    assert "its worst of 3 rounds beats" in verdict_line(same_seed)  # reruns of one traffic: not "seeds"
    assert verdict_line({"one": [run(0, 1, 1)]}).endswith("nothing to compare")


def test_run_takes_the_work_priced_paged_cluster_of_make_run(tmp_path):
    """`slotserve run`'s flags build the cluster `make run` compares policies on: paged K/V
    with prefix caching and a K/V budget per replica, the fake model priced by a fitted cost
    model (scaled); a flat step and a work price together, or a missing cost model, are refused."""
    from cli import common
    from sim.cost_model import FittedCostModel

    cost = str(Path(__file__).resolve().parents[1] / "workloads" / "experiments" / "cost_model.json")
    flags = ["--workload", "kv-pressure", "--kv-cache", "paged", "--prefix-caching", "--kv-budget-tokens", "5632"]
    flags += ["--block-size", "32", "--fake-cost", cost, "--fake-cost-scale", "0.125", "--routing", "precise_prefix"]
    args = build_parser().parse_args(["run", *flags, "round_robin"])
    spec = common.cluster_spec(args)
    engine = spec.replica.engine
    assert (engine.kv_cache, engine.prefix_caching, engine.kv_budget_tokens, engine.block_size) == (
        "paged",
        True,
        5632,
        32,
    )
    assert spec.replica.fake_cost.coefficients == FittedCostModel.load(cost).scaled(0.125).coefficients
    assert spec.replica.fake_step_seconds is None and common.model_label(spec.replica) == "fake work-priced model"
    assert args.workload == "kv-pressure" and args.routing == ["precise_prefix", "round_robin"]
    with pytest.raises(SystemExit, match="not both"):
        common.cluster_spec(build_parser().parse_args(["run", *flags, "--fake-step", "0.01"]))
    with pytest.raises(SystemExit, match="no cost model at"):
        common.cluster_spec(build_parser().parse_args(["run", "--fake-cost", str(tmp_path / "none.json")]))


def test_status_and_top_show_the_routers_starting_and_draining_replicas_without_an_autoscaler():
    """Not autoscaled, a replica's state is the router's: `starting` until its first health
    answer, `draining` while it is drained (even one that never answered), else `serving`;
    `slotserve top` shows the same column."""
    from cli.status import replica_states
    from cli.top import replica_lines

    view = {"report": None, "in_flight": 0, "report_age": None}
    router = {
        "replicas": {r: view for r in ("replica-0", "replica-1", "replica-2", "replica-3")},
        "starting": ["replica-1", "replica-3"],
        "draining": ["replica-2", "replica-3"],
    }
    expected = {"replica-0": "serving", "replica-1": "starting", "replica-2": "draining", "replica-3": "draining"}
    assert replica_states(router, None) == expected
    assert [(line.replica, line.state) for line in replica_lines(router, [])] == sorted(expected.items())
    older = {"replicas": router["replicas"]}  # a router status without the lists: all serving
    assert set(replica_states(older, None).values()) == {"serving"}
