"""Several ingress processes on one port (`slotserve serve --ingress-replicas K`), each a Ray
actor with its own client: connections spread over them, every request lands in the one run,
and killing one under load leaves the others' requests whole while Ray restarts it."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
import ray

from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from cluster.http.ingress_actor import IngressConfig, start_ingresses, stop_ingresses
from cluster.http.server import open_run, replica_info
from metrics.store import MetricsStore
from replica import EngineConfig
from replica.serving.loop import ReplicaConfig
from tests.waiting import wait_until

MODEL = "fake"
FAKE = ReplicaConfig(engine=EngineConfig(num_slots=32, max_seq_len=256), fake_step_seconds=0.02)
TOKENS = 40  # 0.8 s of steps: a kill lands while requests are mid-stream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store_path = str(tmp_path_factory.mktemp("ingress") / "store.db")
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    deployment = start_cluster(ClusterSpec(num_replicas=2, replica=FAKE, store_path=store_path))
    yield deployment, store_path
    stop_cluster()
    ray.shutdown()


def running(deployment) -> int:
    infos = ray.get([r.info.remote() for r in deployment.replicas.values()], timeout=30)
    return sum(i.load.running + i.load.queue_depth for i in infos)


async def stream(url: str, i: int, under_way: list[int] | None = None) -> str:
    """One streamed completion on a connection of its own: "whole" (every token and [DONE]),
    "refused" (no connection), or "cut" (the connection broke mid-answer). Its index joins
    `under_way` once its first tokens are in."""
    body = {"model": MODEL, "prompt": [1 + i % 50, 2], "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    body["return_token_ids"] = True
    tokens, done = 0, False
    try:
        async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
                    if under_way is not None and i not in under_way:
                        under_way.append(i)
    except httpx.ConnectError:
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "cut"
    assert done and tokens == TOKENS, (done, tokens)  # never a partial answer passed off as whole
    return "whole"


def test_two_ingresses_share_one_port_and_record_into_one_run(cluster):
    deployment, store_path = cluster
    recorder = open_run(deployment, replica_info(deployment), "two-ingresses", {})
    port = free_port()
    ingresses = start_ingresses(IngressConfig(port=port, served_name=MODEL, run_id=recorder.run_id), 2)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        outcomes = asyncio.run(_gather(url, 24))
        assert outcomes == ["whole"] * 24
        statuses = ray.get([a.status.remote() for a in ingresses.values()], timeout=30)
        assert len({s.pid for s in statuses}) == 2
        assert all(s.recorded > 0 for s in statuses), statuses  # the kernel spread the connections
    finally:
        recorded = stop_ingresses(ingresses)
        asyncio.run(recorder.close())
    assert recorded == 24
    run = MetricsStore(store_path).requests(recorder.run_id)
    assert len(run) == 24 and {r["finish_reason"] for r in run} == {"length"}


async def _gather(url: str, n: int) -> list[str]:
    return await asyncio.gather(*[stream(url, i) for i in range(n)])


def test_a_killed_ingress_cuts_only_its_own_callers_and_comes_back(cluster):
    """Killed mid-stream: its callers' connections break (never a whole-looking partial
    answer), the other ingress's callers get every token, Ray restarts it on the same port,
    and no request is left running on the replicas."""
    deployment, _ = cluster
    recorder = open_run(deployment, replica_info(deployment), "ingress-kill", {})
    port = free_port()
    ingresses = start_ingresses(IngressConfig(port=port, served_name=MODEL, run_id=recorder.run_id), 2)
    victim = ingresses["slotserve-ingress-0"]
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:

        async def kill_mid_stream() -> list[str]:
            under_way: list[int] = []
            calls = asyncio.gather(*[stream(url, i, under_way) for i in range(32)])
            await asyncio.to_thread(wait_until, lambda: len(under_way) >= 16, 60, "16 streams to be under way")
            ray.kill(victim, no_restart=False)
            return await calls

        outcomes = asyncio.run(kill_mid_stream())
        assert set(outcomes) <= {"whole", "cut", "refused"}
        assert outcomes.count("whole") > 0 and outcomes.count("cut") > 0, outcomes
        status = wait_until(lambda: _restarted(victim), 120, "Ray to restart the killed ingress")
        assert status.restarted
        assert asyncio.run(_gather(url, 16)) == ["whole"] * 16  # both serve again
        wait_until(lambda: running(deployment) == 0, 60, "the cut requests to end on the replicas")
    finally:
        stop_ingresses(ingresses)
        asyncio.run(recorder.close())


def _restarted(actor):
    try:
        if ray.get(actor.wait_started.remote(), timeout=10):
            return ray.get(actor.status.remote(), timeout=10)
    except (ray.exceptions.RayError, TimeoutError):
        return None
    return None
