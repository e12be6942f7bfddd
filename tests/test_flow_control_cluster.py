"""Flow control on a real cluster (a local Ray instance, fake replicas, the router actor with a
flow config) and through the HTTP API: held requests wait at the router and go in priority
order, a held one past its deadline is refused with a Retry-After, a tenant over its limit gets
a 429 naming the limit, and an unknown priority is a 400 naming `priority`. Nothing is lost:
every request of the flood finishes whole."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import ray

from cli.top import flow_lines
from cluster.client import Client
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from cluster.http.server import build_ingress, http_server, serve_http
from protocol.errors import OverloadedError
from protocol.flow import FlowConfig, SaturationConfig, TenantConfig
from replica import EngineConfig
from replica.serving.loop import ReplicaConfig
from tests.test_http_api import free_port
from tests.waiting import wait_until

MODEL = "fake"
# One replica of 2 slots whose 10 ms steps make a 20-token request last 0.2 s: a flood of 12
# saturates it, and the router holds what the replica's queue (1 deep) cannot take.
FAKE = ReplicaConfig(engine=EngineConfig(num_slots=2, max_seq_len=128), fake_step_seconds=0.01)
FLOW = FlowConfig(
    policy="vtc",
    saturation=SaturationConfig(queue_depth=1),
    tenants={
        "limited": TenantConfig(requests_per_s=0.2, burst=1, api_keys=["sk-limited"]),
        "ui": TenantConfig(api_keys=["sk-ui"]),
    },
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store_path = str(tmp_path_factory.mktemp("flow") / "store.db")
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    deployment = start_cluster(ClusterSpec(num_replicas=1, replica=FAKE, store_path=store_path, flow=FLOW))
    ingress = build_ingress(deployment, served_name=MODEL, run_name="flow-test")
    port = free_port()
    server = http_server(ingress, "127.0.0.1", port, None, FLOW.tenant_keys())
    thread = threading.Thread(target=asyncio.run, args=(serve_http(ingress, server),), daemon=True)
    thread.start()
    wait_until(lambda: server.started, 60, "the HTTP server to start")
    with Client() as client:
        yield deployment, client, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=60)
    stop_cluster()
    ray.shutdown()


def _flood_then(client: Client, urgent: dict, flood: int = 12):
    """A flood of batch requests, then (once some are held) one more with `urgent`'s arguments:
    the flood's results, the last one's result (or the error that refused it), and the router's
    status when it first held some."""
    batch = [
        client._loop.spawn(client.agenerate([1, 2, 3], tenant="batch", priority=2, max_tokens=20, ignore_eos=True))
        for _ in range(flood)
    ]

    def holding() -> dict | None:
        status = ray.get(client.router.status.remote(), timeout=30)
        return status if sum(status["flow"]["held"].values()) else None

    held = wait_until(holding, 30, "the router to hold part of the flood", every=0.02)
    try:
        last = client.generate([4, 5, 6], ignore_eos=True, **urgent)
    except OverloadedError as err:
        last = err
    return [future.result(timeout=120) for future in batch], last, held


def test_an_urgent_request_overtakes_a_held_flood_and_the_flood_finishes_whole(cluster):
    _, client, _ = cluster
    flood, urgent, held = _flood_then(client, {"tenant": "ui", "priority": 0, "max_tokens": 4})
    (line,) = flow_lines(held["flow"])  # what `slotserve top` shows of it
    assert f"held by priority band: 0: 0, 1: 0, 2: {held['flow']['held'][2]}" in line and "vtc" in line
    assert urgent.finish_reason == "length" and len(urgent.token_ids) == 4
    overtaken = [r for r in flood if r.completion > urgent.completion]
    assert len(overtaken) >= len(flood) // 2, [r.completion - urgent.completion for r in flood]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 20 for r in flood)


def test_a_request_held_past_its_deadline_is_refused_with_a_retry_after(cluster):
    _, client, _ = cluster
    args = {"tenant": "batch", "priority": 2, "max_tokens": 4, "timeout": 0.3}  # behind its own flood
    flood, late, _ = _flood_then(client, args)
    assert isinstance(late, OverloadedError), late
    assert late.retry_after > 0 and "deadline" in str(late)
    assert all(r.finish_reason == "length" for r in flood)


def test_http_keys_name_the_tenant_and_priority_and_limits_are_clear_errors(cluster):
    """Over HTTP the API key names the tenant (over the body's `user`); a request without a
    tenant's key is a 401; an unknown priority (body or X-Priority header) is a 400 naming
    `priority`; the limited tenant's second request within its bucket's refill is a 429 with a
    Retry-After and the limit named."""
    _, _, url = cluster

    def post(key: str | None, headers: dict | None = None, **extra) -> httpx.Response:
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, **extra}
        return httpx.post(f"{url}/v1/completions", json=body, headers={**auth, **(headers or {})}, timeout=60)

    assert post(None).status_code == 401
    bad = post("sk-ui", priority=7)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert "allowed: 0, 1, 2" in bad.json()["error"]["message"]
    header = post("sk-ui", {"X-Priority": "soon"})
    assert header.status_code == 400 and header.json()["error"]["param"] == "priority"
    ok = post("sk-ui", {"X-Priority": "1"}, user="limited")  # the key's tenant, not the user's
    assert ok.status_code == 200, ok.text
    first, second = post("sk-limited"), post("sk-limited", user="someone-else")
    assert first.status_code == 200, first.text
    assert second.status_code == 429, second.text
    assert float(second.headers["retry-after"]) > 0
    assert "requests_per_s" in second.json()["error"]["message"]
