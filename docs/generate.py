# Over 400 lines: one renderer per kind of committed result and the two reference pages, which
# share the table and block machinery; split, each part would be a few dozen lines.
"""The documentation site's generated parts, written from the code and the committed results so
they cannot drift from either.

Two kinds: whole reference pages (`reference/cli.md` from the argparse parsers of `cli/`,
`reference/experiment-file.md` from the pydantic models of `workloads/experiment.py` and
`workloads/spec.py`), and blocks inside hand-written pages, each between
`<!-- generated: NAME from SOURCE -->` and `<!-- end generated -->`, rendered from the committed
JSON or report SOURCE by the renderer NAME registered in `BLOCKS`. A measured table in the docs
lives in such a block, or in a `<!-- historical: ... -->` block that names the machine and the
date it was measured (tests/test_docs.py checks both, and that every page here is current).

    .venv/bin/python docs/generate.py           # rewrite what is out of date (also: make docs)
    .venv/bin/python docs/generate.py --check   # list what is out of date, exit 1 if anything is
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
if str(ROOT) not in sys.path:  # run as a script: the project's packages sit beside docs/
    sys.path.insert(0, str(ROOT))

BLOCK = re.compile(r"<!-- generated: (?P<name>[a-z0-9-]+) from (?P<source>\S+) -->\n.*?<!-- end generated -->", re.S)
END = "<!-- end generated -->"
REPORTS = ROOT / "workloads" / "experiments"
# The machine of the bench JSONs written before `slotserve bench` recorded it in the file.
MACHINES = {
    "docs/bench_cpu.json": "2-core AMD EPYC, AVX2 and FMA only (no AVX-512), torch 2.13 CPU build",
    "docs/bench_gpu_smollm2.json": "one NVIDIA H200, torch 2.11, transformers 5.17",
    "docs/bench_gpu_gpt2.json": "one NVIDIA H200, torch 2.11, transformers 5.17",
}


def cell(value: object) -> str:
    """A value as one markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def shown(path: Path) -> str:
    """A file as the docs name it: from the repository's root when it lies inside."""
    return (path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).as_posix()


def table(head: list[str], rows: list[list[object]], align: str = "") -> str:
    """A markdown table; `align` has one letter per column, `r` right-aligns it."""
    rule = ["---:" if i < len(align) and align[i] == "r" else "---" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- results (blocks)


def bench(path: Path) -> str:
    """A `slotserve bench` JSON: every row, the machine, and the summary the bench printed."""
    data = json.loads(path.read_text())
    rel = shown(path)
    m = data.get("machine")
    if m:
        machine = (
            f"{m['cpu']} (flags: {m['flags']}), {m['threads']} torch threads; roofs probed in the run: "
            f"fp32 {m['fp32_flops'] / 1e9:.0f} GFLOP/s, bf16 {m['bf16_flops'] / 1e9:.0f} GFLOP/s, "
            f"read {m['read_bytes_per_s'] / 1e9:.1f} GB/s"
        )
    else:
        machine = f"{MACHINES[rel]} (named here: this JSON predates the bench recording its machine)"
    rows = []
    for r in data["rows"]:
        setting = r["dtype"] + (f"+{r['weights']}" if r.get("weights") else "")
        system = f"{r['system']}:{r['engine']}" if r.get("engine") else r["system"]
        speed = f"failed: {r['error']}" if r["error"] else f"{r['useful_tokens_per_s']:.1f}"
        extra = []
        if r.get("ratio_to_hf_decode") is not None:
            extra.append(f"{r['ratio_to_hf_decode']:.2f}x transformers' step")
        if r.get("pct_of_roofline") is not None:
            extra.append(f"{r['pct_of_roofline']:.0f}% of roofline")
        if r.get("host_share") is not None:
            extra.append(f"host {r['host_share']:.0%}")
        if r.get("tag"):
            extra.append(f"({r['tag']} pair)")
        peak = f"{r['peak_mem_mb']:.0f}" if not r["error"] else ""
        rows.append([system, r["policy"] or "-", r["slots"], setting, speed, peak, ", ".join(extra)])
    out = [
        f"Machine: {machine}. Model `{data['model']}`, workload {data['workload']}.",
        "",
        table(["system", "policy / settings", "slots", "dtype", "useful tok/s", "peak MB", "notes"], rows, "__r_rr"),
    ]
    summary = []
    best = data.get("best_slotserve")
    if best:
        setting = f", {best['setting']}" if best.get("setting") else ""
        summary.append(
            f"best slotserve: {best['policy']}, {best['slots']} slots{setting}: {best['useful_tokens_per_s']:.1f} tok/s"
        )
    for peer in ("vllm", "hf-continuous", "hf-static"):
        ratio = data.get(f"ratio_to_{peer}")
        if ratio is None:
            continue
        peer_best = data.get(f"best_{peer}")
        against = f" ({peer_best['setting']}: {peer_best['useful_tokens_per_s']:.1f} tok/s)" if peer_best else ""
        summary.append(f"slotserve's best / {peer}'s best{against}: **{ratio:.2f}x**")
    for key, name in (("best_lossless", "best lossless"), ("best_int8", "best with int8 copies")):
        if b := data.get(key):
            ratios = "".join(
                f", **{b[f'ratio_to_{p}']:.2f}x** {label}"
                for p, label in (("vllm_best", "vLLM's best"), ("vllm_float32", "vLLM's fp32"))
                if f"ratio_to_{p}" in b
            )
            summary.append(
                f"{name}: {b['policy']}, {b['slots']} slots, {b['setting']}: "
                f"{b['useful_tokens_per_s']:.1f} tok/s{ratios}"
            )
    for h in data.get("host_overhead", []):
        unit = ("row" if h["step"] == "decode" else "token") + ("" if h["rows"] == 1 else "s")
        summary.append(
            f"host overhead, {h['dtype']} {h['step']} step of {h['rows']} {unit}: {h['host_ms']:.2f} of "
            f"{h['step_ms']:.2f} ms ({h['host_share']:.0%}) outside matrix products and attention"
        )
    d1 = data.get("decode1")
    if d1:
        summary.append(
            f"single-stream decode: slotserve {d1['slotserve']:.1f} tok/s ({d1['slotserve_setting']}), "
            f"{d1['ratio_to_vllm']:.2f}x vLLM ({d1['vllm']:.1f}), {d1['ratio_to_transformers']:.2f}x transformers "
            f"({d1['transformers']:.1f}); {d1['pct_of_memory_roof']:.0f}% of the batch-1 memory roof"
        )
    for g in data.get("greedy_agreement_vs_fp32", []):
        summary.append(
            f"greedy agreement with slotserve fp32 ({g['policy']}, {g['slots']} slots): {g['system']} "
            f"{g['setting']}: {g['identical']}/{g['requests']} requests identical"
        )
    if data.get("bf16"):
        b = data["bf16"]
        summary.append(
            f"bf16 against fp32 ({b['requests']} requests): {b['speedup_over_fp32']:.2f}x the speed, "
            f"{b['identical_greedy_share']:.0%} of requests with identical greedy output"
        )
    if summary:
        out += ["", *(f"- {line}" for line in summary)]
    return "\n".join(out)


def kv_memory(path: Path) -> str:
    """`benchmarks/kv_memory.py --json`: slot against paged K/V at one budget."""
    data = json.loads(path.read_text())
    a = data["args"]
    rows = [
        [
            r["model"],
            r["cache"],
            r["num_slots"],
            r["requests"],
            f"{r['unused_share']:.1%}",
            f"{r['mean_live']:.1f} / {r['max_live']}",
            f"{r['throughput']:.1f}" + (" (per virtual s)" if r["model"] == "fake" else ""),
            r["preemptions"],
        ]
        for r in data["rows"]
    ]
    return "\n".join(
        [
            f"K/V budget {a['budget']} tokens for both caches, {a['policy']} batching, paged blocks of "
            f"{a['block_size']} tokens for up to {a['paged_slots']} sequences.",
            "",
            table(
                ["model", "cache", "slots", "requests", "unused K/V", "mean / max live", "tokens/s", "preemptions"],
                rows,
                "__rrrrrr",
            ),
        ]
    )


def fidelity(path: Path) -> str:
    """`benchmarks/fidelity.py --json`: the simulator against the real engine, per cost model."""
    data = json.loads(path.read_text())
    m = data["machine"]
    metrics = {"throughput": "throughput", "tpot_p50": "TPOT p50", "ttft_p50": "TTFT p50", "ttft_p99": "TTFT p99"}
    rows = []
    for model, by_metric in data["summary"].items():
        for key, label in metrics.items():
            s = by_metric[key]
            rows.append(
                [model, label, f"{s['median_rel_error']:.1%}", f"{s['spearman']:.2f}", f"{s['real_spread']:.0%}"]
            )
    return "\n".join(
        [
            f"Made on {data['date']} at commit `{data['git_commit'][:10]}` ({m['cpu_count']} CPUs, "
            f"{m['memory_gib']} GiB, {m['platform']}); {data['repeats']} repeats of every real cell.",
            "",
            table(["cost model", "metric", "median rel. error", "Spearman (all cells)", "real spread"], rows, "__rrr"),
        ]
    )


def cost_model(path: Path) -> str:
    """A `slotserve calibrate` JSON: the fitted step time and how well it fits."""
    data = json.loads(path.read_text())
    m, q = data["machine"], data["quality"]
    return (
        f"step = {data['c0'] * 1e3:.0f} ms + {data['c_decode'] * 1e3:.1f} ms per decode token + "
        f"{data['c_prefill'] * 1e3:.1f} ms per prefill token + {data['c_ctx'] * 1e6:.1f} us per attended context token "
        f"+ {data['c_held'] * 1e3:.1f} ms per padding row; held-out R^2 {q['r2']:.3f}, median relative error "
        f"{q['median_rel_error']:.1%} ({q['num_fit']} steps fitted, {q['num_heldout']} held out). Calibrated "
        f"{m['calibrated']} on {m['cpu']} ({m['cores']} cores, {m['threads']} torch thread, torch {m['torch']}), "
        f"{m['model']} {m['dtype']}, {m['num_slots']} slots."
    )


def hardware(path: Path) -> str:
    """HARDWARE.md (written by `benchmarks/hardware.py`) without its title."""
    lines = path.read_text().splitlines()
    return "\n".join(lines[1:] if lines and lines[0].startswith("# ") else lines).strip()


def report_header(path: Path) -> dict[str, str]:
    """What an experiment report says about how it was made."""
    text = path.read_text()
    made = re.search(
        r"(?:Made|Written) by `(?P<cmd>[^`]+)` on (?P<date>[\d-]+)"
        r"(?:, commit| from the runs the store holds, made at commit) `(?P<commit>[^`]+)`",
        text,
    )
    cluster = re.search(r"^- Cluster: (.*)$", text, re.M)
    machine = re.search(r"^- Machine: (.*)$", text, re.M)
    if not (made and cluster and machine):
        raise ValueError(f"{path}: no 'Made by ...', '- Machine:' or '- Cluster:' line")
    cost = re.search(r"simulated: (\w+)", cluster.group(1))
    return {
        "command": made["cmd"],
        "date": made["date"],
        "commit": made["commit"],
        "cluster": cluster.group(1),
        "machine": machine.group(1),
        "toml": next(w for w in made["cmd"].split() if w.endswith((".toml", ".yaml", ".yml"))),
        "simulated": "--simulate" in made["cmd"].split(),
        "cost_model": cost.group(1) if cost else "",
    }


def current_cost_model(toml: str) -> str:
    """The cost model class this code's `--simulate` prices the file's steps with."""
    from experiments.plan import plan_experiment

    return type(plan_experiment(ROOT / toml, simulate=True, allow_outside_paths=True).cost).__name__


def report_status(h: dict[str, typing.Any]) -> str:
    """Whether this code would make the report (its parsed header) again, and why: a simulated
    report is current when it names the cost model class this code simulates with; a run on a
    Ray cluster is a measurement of its day."""
    if not h["simulated"]:
        machine = ", ".join(h["machine"].split(", ")[2:])  # past the host name and the platform string
        return f"historical: measured on a Ray cluster ({machine}) on {h['date']}"
    now = current_cost_model(h["toml"])
    if h["cost_model"] == now:
        return f"current: priced by {now}, as this code's --simulate is"
    return (
        f"historical: priced by {h['cost_model'] or 'an unnamed cost model'}; this code's --simulate uses {now}, "
        "so a rerun gives other figures"
    )


def experiments_index(folder: Path) -> str:
    """Every shipped report: how it was made and whether this code would make it again."""
    rows = []
    for report in sorted(folder.glob("*/report.md")):
        h = report_header(report)
        why = report_status(h)
        rel = shown(report)
        rows.append([f"`{h['toml']}`", f"`{rel}`", f"{h['date']}, `{h['commit'][:7]}`", h["cluster"], why])
    return table(["experiment file", "report", "made (date, commit)", "cluster", "status"], rows)


def results(path: Path) -> list[dict[str, str]]:
    """A report's Results table, a dict per row keyed by the column heads."""
    section = path.read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def report_rows(path: Path, columns: list[str], where: dict[str, str]) -> str:
    """The rows of a report's Results table that match `where`, in `columns`."""
    matching = [values for values in results(path) if all(values.get(k) == v for k, v in where.items())]
    rows = [[values[c] for c in columns] for values in matching]
    made = report_header(path)
    status = report_status(made)
    rows_at = "rows at " + ", ".join(f"{k} {v}" for k, v in where.items()) if where else "every row"
    intro = f"From `{shown(path)}` ({made['date']}; {status}); {rows_at}"
    align = "".join("r" if c not in ("workload", "batching", "routing") else "_" for c in columns)
    return intro + ".\n\n" + table(columns, rows, align)


def ttft_order(twin: Path, real: Path) -> str:
    """The routing policies' TTFT p90 (the median over seeds) on real replicas and on their
    fake twin, each policy's rank on each side, and the Spearman rank correlation of the two."""
    from benchmarks.fidelity import ranks, spearman

    sides = [{r["routing"]: float(r["TTFT p90 s"].split()[0]) for r in results(path)} for path in (real, twin)]
    policies = [p for p in sides[0] if p in sides[1]]
    values = [[side[p] for p in policies] for side in sides]
    order = [ranks(v) for v in values]
    rows = [
        [p, f"{values[0][i]:.3f}", f"{order[0][i]:g}", f"{values[1][i]:.3f}", f"{order[1][i]:g}"]
        for i, p in enumerate(policies)
    ]
    head = ["routing", "real TTFT p90 s", "rank", "fake twin TTFT p90 s", "rank"]
    dates = " and ".join(f"`{shown(p)}` ({report_header(p)['date']})" for p in (real, twin))
    rho = spearman(*values)
    return (
        f"From {dates}: TTFT p90, medians over seeds.\n\n{table(head, rows, '_rrrr')}\n\n"
        f"Spearman rank correlation across the {len(policies)} routing policies: "
        f"{'undefined' if rho is None else f'{rho:.2f}'}."
    )


ROUTING_COLUMNS = ["workload", "routing", "good tok/s", "SLO met %", "TTFT p99 s", "prefix hit %", "imbalance"]
KV_PRESSURE_COLUMNS = [
    "routing",
    "good tok/s",
    "SLO met %",
    "TTFT p50 s",
    "TTFT p90 s",
    "TTFT p99 s",
    "prefix hit %",
    "imbalance",
]
KV_PRESSURE_REAL_COLUMNS = [c for c in KV_PRESSURE_COLUMNS if c != "TTFT p50 s"] + ["TTFT pred MAPE %"]
KV_PRESSURE_REAL = ROOT / "workloads/experiments/kv-pressure-real/report.md"
BLOCKS: dict[str, Callable[[Path], str]] = {
    "bench": bench,
    "kv-memory": kv_memory,
    "fidelity": fidelity,
    "cost-model": cost_model,
    "hardware": hardware,
    "experiments-index": experiments_index,
    "routing-at-095": lambda p: report_rows(p, ROUTING_COLUMNS, {"load": "0.95"}),
    "routing-at-095-real": lambda p: report_rows(p, ROUTING_COLUMNS[1:], {"load": "0.95"}),
    "routing-kv-pressure": lambda p: report_rows(p, KV_PRESSURE_COLUMNS, {"load": "0.8"}),
    "routing-kv-pressure-real": lambda p: report_rows(p, KV_PRESSURE_REAL_COLUMNS, {}),
    "routing-kv-pressure-twin-order": lambda p: ttft_order(p, KV_PRESSURE_REAL),
}


def render_blocks(text: str) -> str:
    """`text` with every generated block rendered afresh from its source."""

    def one(match: re.Match) -> str:
        name, source = match["name"], match["source"]
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r} (known: {', '.join(BLOCKS)})")
        return f"<!-- generated: {name} from {source} -->\n{BLOCKS[name](ROOT / source)}\n{END}"

    return BLOCK.sub(one, text)


# ---------------------------------------------------------------- the CLI reference


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _help(action: argparse.Action, prog: str) -> str:
    """The action's help with argparse's %-placeholders filled in, as `--help` prints it."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS} | {"prog": prog}
    if action.choices is not None:
        params["choices"] = ", ".join(map(str, action.choices))
    return action.help % params


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off" if action.default is False else "on"
    if action.default in (None, argparse.SUPPRESS) or action.required:
        return "required" if action.required else "-"
    if isinstance(action.default, list | tuple):
        return " ".join(map(str, action.default))
    # A default inside the checkout (a shipped file) is shown from the repository's root, so the
    # page reads the same wherever the project was cloned.
    return str(action.default).replace(f"{ROOT}/", "")


def _command(parser: argparse.ArgumentParser, summary: str, level: int) -> list[str]:
    out = [f"{'#' * level} `{parser.prog}`", ""]
    description = inspect.cleandoc(parser.description or summary or "")
    if description:
        out += [description, ""]
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        if action.option_strings and action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            names += f" {' '.join(metavar) if isinstance(metavar, tuple) else metavar}"
        rows.append([names, f"`{_default(action)}`", _help(action, parser.prog)])
    if rows:
        out += [table(["option", "default", "what it does"], rows), ""]
    if parser.epilog:
        out += ["```text", inspect.cleandoc(parser.epilog), "```", ""]
    sub = _subparsers(parser)
    if sub is not None:
        helps = {a.dest: a.help or "" for a in sub._choices_actions}
        for name, child in sub.choices.items():
            out += _command(child, helps.get(name, ""), level + 1)
    return out


def cli_reference() -> str:
    from cli.main import build_parser

    parser = build_parser()
    sub = _subparsers(parser)
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    out = [
        "<!-- generated by docs/generate.py from the argparse parsers of cli/: do not edit -->",
        "# Command line reference",
        "",
        f"{parser.description} Every command prints this with `slotserve COMMAND --help`.",
        "",
        table(["command", "what it does"], [[f"[`{n}`](#slotserve-{n})", helps[n]] for n in sub.choices]),
        "",
    ]
    for name, child in sub.choices.items():
        out += _command(child, helps[name], 2)
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------- the experiment file reference


def _type(annotation: object) -> str:
    """A field's type as a reader of a TOML file thinks of it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args if a is not type(None)) + (
            " (optional)" if type(None) in args else ""
        )
    if origin in (list, tuple):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict or annotation is dict:
        return "table"
    if annotation is typing.Any:
        return "any"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    for base, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "string")):
        if inspect.isclass(annotation) and issubclass(annotation, base):
            return name
    return getattr(annotation, "__name__", str(annotation))


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def _field_default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "its section's defaults"
    return json.dumps(value) if not isinstance(value, str) or value else '""'


def _model(model: type[BaseModel], heading: str) -> list[str]:
    out = [f"### {heading} {{#{model.__name__.lower()}}}", ""]
    if model.__doc__ and model.__doc__ is not BaseModel.__doc__:
        out += [inspect.cleandoc(model.__doc__), ""]
    rows = [
        [f"`{name}`", _type(f.annotation), f"`{_field_default(f)}`", f.description or ""]
        for name, f in model.model_fields.items()
    ]
    return out + [table(["key", "type", "default", "what it is"], rows), ""]


def experiment_reference() -> str:
    from workloads.experiment import Experiment
    from workloads.spec import TraceSpec, WorkloadSpec

    out = [
        "<!-- generated by docs/generate.py from workloads/experiment.py and workloads/spec.py: do not edit -->",
        "# Experiment file reference",
        "",
        "An experiment file (TOML or YAML) is checked against these models before anything runs; an "
        "error names the file, the line and the key. Relative paths in it (a trace, a cost model) are "
        "relative to the file's folder. `slotserve experiment --help` shows a commented example.",
        "",
        "## The file",
        "",
    ]
    seen: set[type[BaseModel]] = set()
    queue: list[tuple[type[BaseModel], str]] = [(Experiment, "Experiment (the top level)")]
    queue += [(m, f"[{name}]") for name, f in Experiment.model_fields.items() for m in _models_in(f.annotation)]
    specs = [(WorkloadSpec, "WorkloadSpec"), (TraceSpec, "TraceSpec")]
    for model, heading in queue:
        seen.add(model)
        out += _model(model, heading)
    out += [
        "## Workload specs",
        "",
        "A full `[workload] spec` (and what a standard workload expands to) is one of these; "
        '`source = "trace"` selects a TraceSpec. Nested tables take the `kind` shown.',
        "",
    ]
    while specs:
        model, heading = specs.pop(0)
        if model in seen:
            continue
        seen.add(model)
        out += _model(model, heading)
        specs += [(m, m.__name__) for f in model.model_fields.values() for m in _models_in(f.annotation)]
    example = REPORTS / "slot_efficiency.toml"
    out += [
        "## An example",
        "",
        f"`{shown(example)}`, as shipped:",
        "",
        "```toml",
        example.read_text().rstrip(),
        "```",
    ]
    return "\n".join(out).rstrip() + "\n"


PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_reference,
    "reference/experiment-file.md": experiment_reference,
}


def expected(page: Path) -> str:
    """What `page` (under docs/) should hold: a reference page afresh, or its blocks re-rendered."""
    rel = page.relative_to(DOCS).as_posix()
    if rel in PAGES:
        return PAGES[rel]()
    return render_blocks(page.read_text())


def pages() -> list[Path]:
    return sorted({*DOCS.rglob("*.md"), *(DOCS / rel for rel in PAGES)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the docs' generated pages and blocks.")
    parser.add_argument("--check", action="store_true", help="only list what is out of date (exit 1 if any)")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        want = expected(page)
        if not page.exists() or page.read_text() != want:
            stale.append(page)
            if not args.check:
                page.parent.mkdir(parents=True, exist_ok=True)
                page.write_text(want)
    verb = "out of date" if args.check else "rewritten"
    for page in stale:
        print(f"{verb}: {page.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
