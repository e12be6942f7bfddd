"""guidellm (a load generator no one here wrote) against `slotserve serve` with 2 replicas of the
default model, and its report next to `slotserve report` of the same run.

The script runs `slotserve serve --replicas 2` (which starts the cluster, loopback only),
drives it with guidellm from its own virtual environment (`make guidellm`), bounded in
requests and time, stops the server (which closes the run and the cluster) and prints both
reports as Markdown tables with their differences.

What each side measures: guidellm times from just before it sends the HTTP request to the
chunk it parses; the store times from the ingress receiving the request to the ingress
receiving each token. So guidellm's TTFT is the store's plus the HTTP round trip and its own
client overhead. guidellm's "ITL" is each request's mean gap between tokens after the first
((last - first) / (n - 1)), which is the store's TPOT; the store's ITL (every gap, pooled) is
shown beside it.

    make guidellm && .venv/bin/python benchmarks/http_guidellm.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replica.model.loader import default_model_dir  # noqa: E402

GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
MODEL = "smollm2-135m"


def start_server(port: int, store: str) -> tuple[subprocess.Popen, int]:
    """`slotserve serve` with 2 replicas of 8 slots; returns it and the run it records."""
    args = [sys.executable, "-m", "cli.main", "serve", "--replicas", "2", "--slots", "8", "--max-seq-len", "256"]
    args += ["--port", str(port), "--store", store, "--run-name", "guidellm"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = ""
    while "recording run" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"slotserve serve exited with {proc.returncode}")
    run_id = int(line.split("recording run ")[1].split(";")[0])
    while True:  # the run is open before the port is bound
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc, run_id
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def run_guidellm(port: int, out: Path, args: argparse.Namespace) -> dict:
    command = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={MODEL},request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={args.streams}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--constraint", f"kind=max_duration,seconds={args.max_seconds}",
        "--tokenizer", f"kind=huggingface_auto,model={default_model_dir()}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(command, check=True, timeout=args.max_seconds + 300, env=env, cwd=out.parent)
    return json.loads(out.read_text())


def guidellm_figures(report: dict) -> dict[str, dict[str, float]]:
    """TTFT and per-request ITL percentiles (seconds) of guidellm's one benchmark, successful requests."""
    metrics = report["benchmarks"][0]["metrics"]
    figures = {}
    for name, key in (("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms")):
        dist = metrics[key]["successful"]
        pct = dist["percentiles"]
        figures[name] = {"p50": pct["p50"] / 1000, "p90": pct["p90"] / 1000, "p99": pct["p99"] / 1000}
        figures[name]["count"] = dist["count"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--streams", type=int, default=8, help="guidellm's concurrent streams")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8765, help="loopback port of `slotserve serve`")
    parser.add_argument("--max-seconds", type=int, default=240, help="guidellm stops after this long")
    args = parser.parse_args()
    if not GUIDELLM.exists():
        raise SystemExit(f"{GUIDELLM} is missing: run `make guidellm`")
    work = Path(tempfile.mkdtemp(prefix="slotserve-guidellm-"))
    store = str(work / "store.db")
    port = args.port
    server, run_id = start_server(port, store)
    try:
        started = time.time()
        guide = guidellm_figures(run_guidellm(port, work / "guidellm.json", args))
        took = time.time() - started
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    report_json = subprocess.run(
        [sys.executable, "-m", "cli.main", "report", "--store", store, str(run_id), "--json"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    ours = json.loads(report_json)[0]["cluster"]

    print(
        f"guidellm: {args.requests} requests, {args.streams} concurrent streams, prompts {args.prompt_tokens} tokens,"
    )
    print(f"outputs {args.output_tokens} tokens, 2 replicas of {MODEL} (8 slots each), {took:.0f} s; run {run_id}")
    print(f"slotserve report: {ours['num_requests']} requests, {ours['output_tokens']} output tokens\n")
    print("| metric | guidellm p50 | store p50 | guidellm p90 | store p90 | guidellm p99 | store p99 |")
    print("|---|---|---|---|---|---|---|")
    rows = (("TTFT", guide["ttft"], ours["ttft"]), ("ITL (per request) vs TPOT", guide["itl"], ours["tpot"]))
    for name, g, s in rows:
        cells = " | ".join(f"{g[p] * 1000:.1f} ms | {s[p] * 1000:.1f} ms" for p in ("p50", "p90", "p99"))
        print(f"| {name} | {cells} |")
    print(f"| store ITL (every gap) | | {ours['itl']['p50'] * 1000:.1f} ms | | {ours['itl']['p90'] * 1000:.1f} ms | "
          f"| {ours['itl']['p99'] * 1000:.1f} ms |")  # fmt: skip
    print()
    for name, g, s in rows:
        diffs = ", ".join(f"{p} {(g[p] - s[p]) * 1000:+.1f} ms ({g[p] / s[p] - 1:+.1%})" for p in ("p50", "p90"))
        print(f"{name}: guidellm - store: {diffs}")


if __name__ == "__main__":
    main()
