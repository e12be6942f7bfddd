"""A raw HTTP/1.1 keep-alive load generator on asyncio protocols under uvloop, for the front
door's figures: a Python generator built on `httpx` tops out near a few hundred requests/s on
two cores, so it measures itself more than the server.

Closed loop (`--concurrency C`): C connections, each sending its next request when the last
answer is in. Open loop (`--rate R`): Poisson arrivals at R/s, each sent on an idle connection
(a new one opened when none is idle), its latency counted from its planned arrival, so a server
that falls behind shows as latency, not as a lower offered rate. A streamed request
(`"stream": true` in the body) is timed at its first server-sent event and at its end.

It prints one JSON object: requests answered, errors by kind, seconds, requests/s, latency and
time-to-first-byte percentiles (ms), and this process's own CPU seconds. Run it in a process
of its own:

    python benchmarks/http_loadgen.py --url http://127.0.0.1:8000/v1/completions \
        --body '{"model": "fake", "prompt": [1, 2, 3], "max_tokens": 4}' --concurrency 64 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np
import uvloop

HEADER_END = b"\r\n\r\n"


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer parsed from the bytes
    (Content-Length or chunked), its first body byte and its end timed."""

    def __init__(self, request: bytes):
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.connected = asyncio.get_running_loop().create_future()
        self.done: asyncio.Future | None = None
        self.buffer = bytearray()
        self.first_byte: float | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.connected.set_result(None)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    def send(self) -> asyncio.Future:
        self.buffer.clear()
        self.first_byte = None
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(self.request)
        return self.done

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(HEADER_END)
        if end < 0 or self.done is None or self.done.done():
            return
        body_start = end + 4
        if self.first_byte is None and len(self.buffer) > body_start:
            self.first_byte = time.perf_counter()
        head = bytes(self.buffer[:end]).lower()
        status = int(head[9:12])
        if b"transfer-encoding: chunked" in head:
            if self.buffer.endswith(b"0\r\n\r\n"):
                self.done.set_result(status)
        else:
            at = head.find(b"content-length:")
            length = int(head[at + 15 : head.index(b"\r\n", at) if b"\r\n" in head[at:] else None]) if at >= 0 else 0
            if len(self.buffer) - body_start >= length:
                self.done.set_result(status)


class Generator:
    def __init__(self, url: str, body: bytes, max_connections: int):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.request = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.idle: list[Connection] = []
        self.open = 0
        self.max_connections = max_connections
        self.tally = Tally()

    async def connection(self) -> Connection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
            self.open -= 1
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: Connection(self.request), self.host, self.port)
        self.open += 1
        return conn

    async def one(self, start: float) -> None:
        """One request, timed from `start` (its planned arrival, or its send)."""
        try:
            conn = await self.connection()
        except OSError as err:
            self.tally.error(type(err).__name__)
            return
        try:
            status = await asyncio.wait_for(conn.send(), 60)
        except (ConnectionError, TimeoutError) as err:
            self.tally.error(type(err).__name__)
            conn.transport.close()
            self.open -= 1
            return
        end = time.perf_counter()
        if status != 200:
            self.tally.error(f"HTTP {status}")
        else:
            self.tally.latencies.append(end - start)
            self.tally.first_bytes.append((conn.first_byte or end) - start)
        self.idle.append(conn)

    async def closed_loop(self, concurrency: int, seconds: float) -> float:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                await self.one(time.perf_counter())

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.perf_counter() - start

    async def open_loop(self, rate: float, seconds: float, seed: int) -> float:
        rng = random.Random(seed)
        start = time.perf_counter()
        planned, tasks = start, []
        while planned < start + seconds:
            delay = planned - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self.one(planned)))
            planned += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        return time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ms = np.asarray(values) * 1000
    return {f"p{q}": round(float(np.percentile(ms, q)), 3) for q in (50, 90, 99)} | {"max": round(float(ms.max()), 3)}


async def run(args: argparse.Namespace) -> dict:
    gen = Generator(args.url, args.body.encode(), args.concurrency or 1024)
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    if args.rate:
        seconds = await gen.open_loop(args.rate, args.seconds, args.seed)
    else:
        seconds = await gen.closed_loop(args.concurrency, args.seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    answered = len(gen.tally.latencies)
    return {
        "mode": f"rate {args.rate:g}/s" if args.rate else f"concurrency {args.concurrency}",
        "answered": answered,
        "errors": gen.tally.errors,
        "seconds": round(seconds, 3),
        "requests_per_s": round(answered / seconds, 1),
        "latency_ms": percentiles(gen.tally.latencies),
        "first_byte_ms": percentiles(gen.tally.first_bytes),
        "connections": gen.open,
        "cpu_s": round(after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the POST target, e.g. http://127.0.0.1:8000/v1/completions")
    parser.add_argument("--body", required=True, help="the JSON body every request sends")
    parser.add_argument("--concurrency", type=int, default=0, help="closed loop: connections sending back to back")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson arrivals per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to send")
    parser.add_argument("--seed", type=int, default=0, help="the open loop's arrival seed")
    args = parser.parse_args()
    if bool(args.concurrency) == bool(args.rate):
        parser.error("give exactly one of --concurrency and --rate")
    print(json.dumps(uvloop.run(run(args))))


if __name__ == "__main__":
    main()
