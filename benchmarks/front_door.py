"""The front door's capacity: how many requests/s slotserve's HTTP ingress (and the Python
client) pass to flat-cost fake replicas whose steps cost `--step` (1 ms), so the front door is
the limit, against Ray Serve's front door (its HTTP proxy and router) over the same replicas in
the same run.

1. The load generator's own ceiling: `benchmarks/http_loadgen.py` (raw keep-alive HTTP/1.1 on
   asyncio protocols under uvloop, a process of its own) and wrk (compiled, Debian's `wrk`),
   against a bare ASGI app under uvicorn that answers a fixed completion: what the generator can
   measure at most on this machine, printed beside every figure.
2. slotserve: `--replicas` fake replicas, the router actor, `--ingress-replicas` ingress processes
   on one port (`cluster.http.ingress_actor`), routing through the router actor or inside each
   ingress (`--ingress-routing`). HTTP non-streamed and streamed (SSE) completions of `--tokens`
   tokens at each `--concurrency` (closed loop), wrk at 64 connections, an open-loop rate sweep
   (`--rates`, Poisson arrivals, latency from each planned arrival), and the Python client
   (`slotserve.Client`, a process of its own) closed loop. CPU seconds per request of the
   ingress processes and the router actor, from /proc, over the non-streamed run at 64.
3. Ray Serve (`cluster.serve_front_door`): its proxy and default router in front of as many
   replicas of the same engine, the same HTTP runs.
4. What the front door adds: latency at concurrency 1 minus the engine's own time for the same
   request (the serving loop in this process, no Ray, no HTTP).

Everything shares this machine's cores with the load generator, so on 2 cores each figure is
what the whole machine sustains with the front door in it.

    .venv/bin/python benchmarks/front_door.py [--replicas 4] [--ingress-replicas 2] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol.cpu import cpu_info  # noqa: E402

LOADGEN = str(ROOT / "benchmarks" / "http_loadgen.py")
MODEL = "fake"
TICKS = os.sysconf("SC_CLK_TCK")


def body(tokens: int, stream: bool) -> str:
    return json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": tokens, "ignore_eos": True, "stream": stream})


def loadgen(url: str, payload: str, seconds: float, concurrency: int = 0, rate: float = 0.0) -> dict:
    mode = ["--rate", str(rate)] if rate else ["--concurrency", str(concurrency)]
    command = [sys.executable, LOADGEN, "--url", url, "--body", payload, "--seconds", str(seconds), *mode]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True, timeout=600).stdout)


def wrk(url: str, payload: str, seconds: float, connections: int) -> dict:
    """wrk's requests/s and latency percentiles (ms) for POSTs of `payload`."""
    script = Path(f"/tmp/slotserve-front-door-{os.getpid()}.lua")
    script.write_text(
        f'wrk.method = "POST"\nwrk.body = {json.dumps(payload)}\nwrk.headers["Content-Type"] = "application/json"\n'
    )
    command = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script), url]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600).stdout
    figures: dict = {"latency_ms": {}}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("Requests/sec:"):
            figures["requests_per_s"] = float(words[1])
        elif len(words) == 2 and words[0] in ("50%", "90%", "99%"):
            figures["latency_ms"][f"p{words[0][:-1]}"] = _ms(words[1])
        elif "Non-2xx" in line or "Socket errors" in line:
            figures["errors"] = line.strip()
    return figures


def _ms(text: str) -> float:
    for unit, scale in (("us", 0.001), ("ms", 1.0), ("s", 1000.0)):
        if text.endswith(unit):
            return round(float(text[: -len(unit)]) * scale, 3)
    return float(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit(f"nothing listens on port {port} after {timeout:g} s")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS


# ---- 1. the generator's ceiling -------------------------------------------------------------
BARE_BODY = b'{"id":"cmpl-0","object":"text_completion","choices":[{"index":0,"text":"","finish_reason":"length"}]}'


async def bare_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BARE_BODY)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BARE_BODY})


def serve_bare_app(port: int) -> None:
    import uvicorn

    uvicorn.run(bare_app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")


def ceiling(args) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--bare-app", str(port)])
    try:
        wait_listening(port)
        url = f"http://127.0.0.1:{port}/v1/completions"
        return {
            "loadgen": loadgen(url, body(args.tokens, False), args.seconds, concurrency=64),
            "wrk": wrk(url, body(args.tokens, False), args.seconds, 64),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- 2. and 3. the HTTP runs, the same for both front doors ----------------------------------
def http_runs(args, url: str) -> dict:
    runs: dict = {"wrk_64": wrk(url, body(args.tokens, False), args.seconds, 64)}
    for stream in (False, True):
        for c in args.concurrency:
            runs[f"{'stream' if stream else 'plain'}_{c}"] = loadgen(url, body(args.tokens, stream), args.seconds, c)
    for rate in args.rates:
        runs[f"rate_{rate:g}"] = loadgen(url, body(args.tokens, False), args.seconds, rate=rate)
    return runs


def replica_config(args):
    from replica import EngineConfig
    from replica.serving.loop import ReplicaConfig

    return ReplicaConfig(
        engine=EngineConfig(num_slots=256, max_seq_len=128), fake_step_seconds=args.step, max_queue=1024
    )


def slotserve_runs(args) -> dict:
    import ray

    from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
    from cluster.http.ingress_actor import IngressConfig, start_ingresses, stop_ingresses
    from cluster.http.server import open_run, replica_info

    spec = ClusterSpec(
        num_replicas=args.replicas,
        replica=replica_config(args),
        num_cpus_per_replica=0.25,
        routing_policy=args.routing,
        store_path=args.store,
        max_in_flight_per_replica=1024,
    )
    deployment = start_cluster(spec)
    recorder = open_run(deployment, replica_info(deployment), "front-door", {})
    port = free_port()
    config = IngressConfig(port=port, served_name=MODEL, run_id=recorder.run_id, routing=args.ingress_routing)
    ingresses = start_ingresses(config, args.ingress_replicas)
    try:
        ingress_pids = [s.pid for s in ray.get([a.status.remote() for a in ingresses.values()])]
        router = [ray.get(deployment.router.__ray_call__.remote(lambda _: os.getpid()))]
        url = f"http://127.0.0.1:{port}/v1/completions"
        runs = http_runs(args, url)
        before = {name: cpu_seconds(pids) for name, pids in (("ingress", ingress_pids), ("router", router))}
        run = loadgen(url, body(args.tokens, False), args.seconds, concurrency=64)
        for name, pids in (("ingress", ingress_pids), ("router", router)):
            runs[f"{name}_cpu_s_per_request"] = (cpu_seconds(pids) - before[name]) / max(1, run["answered"])
        gcs = ray.get_runtime_context().gcs_address
        runs["python"] = {
            c: json.loads(
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--python-client",
                        gcs,
                        "--clients",
                        str(c),
                        "--seconds",
                        str(args.seconds),
                        "--tokens",
                        str(args.tokens),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=600,
                ).stdout.splitlines()[-1]
            )  # fmt: skip
            for c in args.concurrency
        }
    finally:
        stop_ingresses(ingresses)
        asyncio.run(recorder.close())
        stop_cluster()
    return runs


def python_client_main(gcs: str, clients: int, seconds: float, tokens: int) -> None:
    """Closed loop through the Python client, in a process of its own; prints one JSON line."""
    import numpy as np
    import ray

    from cluster.client import Client

    ray.init(address=gcs, namespace="slotserve", log_to_driver=False, logging_level="ERROR")
    client = Client()

    async def run() -> tuple[list[float], float]:
        latencies: list[float] = []
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                start = time.perf_counter()
                await client.agenerate([1, 2, 3], max_tokens=tokens, ignore_eos=True)
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(clients)])
        return latencies, time.perf_counter() - start

    latencies, took = asyncio.run(run())
    ms = np.asarray(latencies) * 1000
    print(
        json.dumps(
            {
                "requests_per_s": round(len(latencies) / took, 1),
                "latency_ms": {f"p{q}": round(float(np.percentile(ms, q)), 3) for q in (50, 99)},
            }
        )
    )


def serve_runs(args) -> dict:
    from cluster.serve_front_door import start_serve_front_door, stop_serve_front_door

    port = free_port()
    start_serve_front_door(replica_config(args), args.replicas, port, num_cpus=0.25)
    try:
        wait_listening(port)
        return http_runs(args, f"http://127.0.0.1:{port}/v1/completions")
    finally:
        stop_serve_front_door()


def engine_alone(args, requests: int = 200) -> float:
    """The median seconds of one request on the serving loop alone (no Ray, no HTTP)."""
    from replica.serving.loop import AsyncEngine, build_engine

    serving = AsyncEngine(build_engine(replica_config(args)), lambda _: None)

    async def run() -> list[float]:
        took = []
        for i in range(requests):
            start = time.perf_counter()
            async for _ in serving.generate([1, 2, 3], {"max_tokens": args.tokens, "ignore_eos": True}, f"e{i}"):
                pass
            took.append(time.perf_counter() - start)
        return sorted(took)

    return asyncio.run(run())[requests // 2]


# ---- the report -------------------------------------------------------------------------------
def row(name: str, ours: dict, peer: dict | None, ceiling_rps: float) -> str:
    rps, p50, p99 = ours["requests_per_s"], ours["latency_ms"].get("p50"), ours["latency_ms"].get("p99")
    peer_rps = peer["requests_per_s"] if peer else None
    ratio = f"{rps / peer_rps:.2f}x" if peer_rps else "-"
    peer_text = f"{peer_rps:.0f} (p99 {peer['latency_ms'].get('p99')} ms)" if peer else "-"
    errors = ours.get("errors") or ""
    return f"| {name} | {rps:.0f} | {p50} | {p99} | {peer_text} | {ratio} | {rps / ceiling_rps:.0%} | {errors} |"


def report(args, top: dict, ours: dict, serve: dict | None, alone: float) -> None:
    print(f"\nmachine: {cpu_info().describe()}")
    print(
        f"{args.replicas} fake replicas ({args.step * 1000:g} ms steps), {args.tokens}-token completions, "
        f"{args.ingress_replicas} ingress process(es) routing via {args.ingress_routing} ({args.routing}), "
        f"{args.seconds:g} s per figure"
    )
    gen, w = top["loadgen"]["requests_per_s"], top["wrk"]["requests_per_s"]
    print(f"generator ceiling (bare ASGI app, 64 connections): http_loadgen {gen:.0f} req/s, wrk {w:.0f} req/s")
    print("\n| run | req/s | p50 ms | p99 ms | Ray Serve req/s | vs Serve | of ceiling | errors |")
    print("|---|---|---|---|---|---|---|---|")
    print(row("wrk, 64 connections, not streamed", ours["wrk_64"], serve and serve["wrk_64"], w))
    for key in [k for k in ours if k.startswith(("plain_", "stream_", "rate_"))]:
        label = key.replace("plain_", "not streamed, concurrency ").replace("stream_", "streamed, concurrency ")
        label = label.replace("rate_", "open loop, offered req/s ")
        print(row(label, ours[key], serve and serve.get(key), gen))
    print("\n| Python client, concurrency | req/s | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    for c, run in ours["python"].items():
        print(f"| {c} | {run['requests_per_s']:.0f} | {run['latency_ms']['p50']} | {run['latency_ms']['p99']} |")
    one = ours.get("plain_1")
    if one:
        adds = one["latency_ms"]["p50"] - alone * 1000
        print(
            f"\nengine alone: {alone * 1000:.2f} ms a request; at concurrency 1 the front door adds {adds:.2f} ms (p50)"
        )
    print(
        f"CPU per request at concurrency 64: ingress {ours['ingress_cpu_s_per_request'] * 1000:.2f} ms, "
        f"router {ours['router_cpu_s_per_request'] * 1000:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4, help="fake replicas")
    parser.add_argument("--step", type=float, default=0.001, help="fake step seconds")
    parser.add_argument("--tokens", type=int, default=4, help="tokens per completion")
    parser.add_argument("--ingress-replicas", type=int, default=2, help="slotserve ingress processes on one port")
    parser.add_argument("--ingress-routing", choices=["actor", "local"], default="actor")
    parser.add_argument("--routing", default="least_loaded", help="slotserve's routing policy")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rates", type=float, nargs="*", default=[250, 500, 1000], help="open-loop req/s")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per figure")
    parser.add_argument("--no-serve", action="store_true", help="skip Ray Serve's front door")
    parser.add_argument("--store", default="/tmp/slotserve-front-door.db")
    parser.add_argument("--json", help="also write every figure to this JSON file")
    parser.add_argument("--bare-app", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--python-client", help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_app:
        serve_bare_app(args.bare_app)
        return
    if args.python_client:
        python_client_main(args.python_client, args.clients, args.seconds, args.tokens)
        return
    import ray

    print(f"machine: {cpu_info().describe()}", flush=True)
    top = ceiling(args)
    alone = engine_alone(args)
    ray.init(address="local", num_cpus=8, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    try:
        ours = slotserve_runs(args)
        serve = None if args.no_serve else serve_runs(args)
    finally:
        ray.shutdown()
    report(args, top, ours, serve, alone)
    if args.json:
        Path(args.json).write_text(json.dumps({"ceiling": top, "slotserve": ours, "serve": serve, "alone": alone}))


if __name__ == "__main__":
    main()
