"""What the HTTP layer costs: `slotserve serve` (one ingress process) in front of 2 fake-model
replicas, driven by concurrent streaming HTTP clients in a separate process, against the
Python client on the same cluster in the same run.

1. Overhead: rounds of `--clients` concurrent streams (token-id prompts, `--tokens` tokens
   each, EOS ignored), the Python client's round and the HTTP round alternating. Each side
   measures on its own clock: TTFT from just before sending to the first token, ITL every gap
   between tokens. Printed: p50 and p99 of each, and what HTTP adds.
2. Throughput: `--rate-clients` concurrent clients each sending short requests back to back
   for `--rate-seconds` against replicas whose steps take 1 ms: the requests/s one ingress
   process completes, next to the Python client's on the same cluster.

The HTTP load generator is this script run with `--client` (httpx, one event loop); on the
2-core development machine it shares the cores with the ingress and the replicas, so the
figures are a floor for the ingress, not a ceiling.

    .venv/bin/python benchmarks/http_load.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import ray

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.client import Client  # noqa: E402
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster  # noqa: E402
from replica import EngineConfig  # noqa: E402
from replica.serving.loop import ReplicaConfig  # noqa: E402

MODEL = "fake"


# ---- the HTTP load generator (run as a separate process) ------------------------------------
async def http_stream(http: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    body["return_token_ids"] = True
    sent, times = time.time(), []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                now = time.time()
                choices = json.loads(line[6:])["choices"]
                times += [now] * (len(choices[0]["token_ids"]) if choices else 0)
    return {"sent": sent, "times": times}


async def http_round(url: str, clients: int, tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        return await asyncio.gather(*[http_stream(http, url, [1 + i % 50, 7, 9], tokens) for i in range(clients)])


async def http_rate(url: str, clients: int, seconds: float) -> int:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    end, done = time.time() + seconds, 0
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def loop(i: int) -> None:
            nonlocal done
            while time.time() < end:
                await http_stream(http, url, [1 + i % 50, 3], 4)
                done += 1

        await asyncio.gather(*[loop(i) for i in range(clients)])
    return done


def client_main(args: argparse.Namespace) -> None:
    if args.client_mode == "round":
        print(json.dumps(asyncio.run(http_round(args.client, args.clients, args.tokens))))
    else:
        print(json.dumps(asyncio.run(http_rate(args.client, args.rate_clients, args.rate_seconds))))


def run_client(args: argparse.Namespace, url: str, mode: str):
    command = [sys.executable, __file__, "--client", url, "--client-mode", mode, "--clients", str(args.clients)]
    command += ["--tokens", str(args.tokens), "--rate-clients", str(args.rate_clients)]
    command += ["--rate-seconds", str(args.rate_seconds)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True, timeout=600).stdout)


# ---- the Python client on the same cluster ------------------------------------------------------
async def python_round(client: Client, clients: int, tokens: int) -> list[dict]:
    async def one(i: int) -> dict:
        sent = time.time()
        result = await client.agenerate([1 + i % 50, 7, 9], max_tokens=tokens, ignore_eos=True)
        return {"sent": sent, "times": result.token_times}

    return await asyncio.gather(*[one(i) for i in range(clients)])


async def python_rate(client: Client, clients: int, seconds: float) -> int:
    end, done = time.time() + seconds, 0

    async def loop(i: int) -> None:
        nonlocal done
        while time.time() < end:
            await client.agenerate([1 + i % 50, 3], max_tokens=4, ignore_eos=True)
            done += 1

    await asyncio.gather(*[loop(i) for i in range(clients)])
    return done


# ---- the run ----------------------------------------------------------------------------------
def latencies(streams: list[dict], tokens: int) -> tuple[np.ndarray, np.ndarray]:
    complete = [s for s in streams if len(s["times"]) == tokens]
    if len(complete) != len(streams):
        raise SystemExit(f"{len(streams) - len(complete)} of {len(streams)} streams did not complete")
    ttft = np.array([s["times"][0] - s["sent"] for s in complete])
    itl = np.concatenate([np.diff(s["times"]) for s in complete])
    return ttft, itl


def serve(gcs: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "cli.main", "serve", "--address", gcs, "--port", str(port)]
    proc = subprocess.Popen([*command, "--served-model-name", MODEL, "--run-name", "http-load"], cwd=ROOT)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("slotserve serve did not become healthy")


def measure(args: argparse.Namespace, step: float, slots: int) -> tuple[subprocess.Popen, Client]:
    stop_cluster()
    replica = ReplicaConfig(engine=EngineConfig(num_slots=slots, max_seq_len=128), fake_step_seconds=step)
    spec = ClusterSpec(num_replicas=2, replica=replica, num_cpus_per_replica=0.5, store_path=args.store)
    start_cluster(spec)
    return serve(ray.get_runtime_context().gcs_address, args.port), Client()


def stop(proc: subprocess.Popen, client: Client) -> None:
    client.close()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent streams per round (>= 64)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating")
    parser.add_argument("--step", type=float, default=0.02, help="fake step seconds in the overhead part")
    parser.add_argument("--rate-clients", type=int, default=64)
    parser.add_argument("--rate-seconds", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--store", default="/tmp/slotserve-http-load.db")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--client-mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args)
        return
    url = f"http://127.0.0.1:{args.port}"
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)

    proc, client = measure(args, args.step, slots=args.clients)
    http_streams, python_streams = [], []
    for _ in range(args.rounds):
        python_streams += asyncio.run(python_round(client, args.clients, args.tokens))
        http_streams += run_client(args, url, "round")
    stop(proc, client)
    (p_ttft, p_itl), (h_ttft, h_itl) = latencies(python_streams, args.tokens), latencies(http_streams, args.tokens)
    print(f"overhead: 2 fake replicas ({args.step * 1000:g} ms steps, {args.clients} slots each), {args.rounds} rounds "
          f"of {args.clients} concurrent streams x {args.tokens} tokens per side; all {len(http_streams)} HTTP and "
          f"{len(python_streams)} Python-client streams complete")  # fmt: skip
    print("| metric | Python client | HTTP | HTTP adds |")
    print("|---|---|---|---|")
    for name, py, ht in (("TTFT", p_ttft, h_ttft), ("ITL", p_itl, h_itl)):
        for q in (50, 99):
            a, b = np.percentile(py, q) * 1000, np.percentile(ht, q) * 1000
            print(f"| {name} p{q} | {a:.2f} ms | {b:.2f} ms | {b - a:+.2f} ms ({b / a:.2f}x) |")

    proc, client = measure(args, 0.001, slots=args.rate_clients)
    http_done = run_client(args, url, "rate")
    python_done = asyncio.run(python_rate(client, args.rate_clients, args.rate_seconds))
    stop(proc, client)
    http_rate_, python_rate_ = http_done / args.rate_seconds, python_done / args.rate_seconds
    print(f"\nthroughput: {args.rate_clients} clients back to back for {args.rate_seconds:g} s each side, "
          "4-token streamed requests, 1 ms fake steps")  # fmt: skip
    print(
        f"one ingress process: {http_rate_:.0f} requests/s; Python client: {python_rate_:.0f} requests/s "
        f"(HTTP / Python {http_rate_ / python_rate_:.2f})"
    )
    stop_cluster()
    ray.shutdown()


if __name__ == "__main__":
    main()
