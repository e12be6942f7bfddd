"""The OpenAI-compatible HTTP API on a real local Ray cluster of two fake-model replicas, driven
by the official `openai` package and by raw HTTP (httpx): answers and usage, every error's
status and body, the abort of a disconnected stream, the run recorded in the store, and
`slotserve serve` joining the cluster as a command."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai
import pytest
import ray

from cluster.client import Client
from cluster.deploy import ClusterSpec, Deployment, start_cluster, stop_cluster
from cluster.http.server import build_ingress, http_server, serve_http
from metrics.store import MetricsStore
from replica import EngineConfig
from replica.serving.loop import ReplicaConfig
from tests.waiting import wait_until

MODEL = "fake"
KEY = "test-key"
# 4 slots and at most 2 waiting per replica: a burst of 24 long requests overflows 2 replicas.
FAKE = ReplicaConfig(engine=EngineConfig(num_slots=4, max_seq_len=256), fake_step_seconds=0.01, max_queue=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    deployment: Deployment
    store_path: str
    run_id: int

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, **kwargs)

    def post(self, path: str, body: dict | str, key: str | None = KEY, headers: dict | None = None) -> httpx.Response:
        headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
        content = body if isinstance(body, str) else None
        headers["Content-Type"] = "application/json"
        return httpx.post(
            f"{self.url}{path}", json=None if content else body, content=content, headers=headers, timeout=60
        )

    def running(self) -> int:
        """Requests running or waiting on the replicas, as they report it."""
        infos = ray.get([r.info.remote() for r in self.deployment.replicas.values()], timeout=30)
        return sum(i.load.running + i.load.queue_depth for i in infos)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    store_path = str(tmp_path_factory.mktemp("http") / "store.db")
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    deployment = start_cluster(ClusterSpec(num_replicas=2, replica=FAKE, store_path=store_path))
    ingress = build_ingress(deployment, served_name=MODEL, run_name="http-test")
    port = free_port()
    server = http_server(ingress, "127.0.0.1", port, KEY)
    thread = threading.Thread(target=asyncio.run, args=(serve_http(ingress, server),), daemon=True)
    thread.start()
    wait_until(lambda: server.started, 60, "the HTTP server to start")
    yield Served(f"http://127.0.0.1:{port}", deployment, store_path, ingress.recorder.run_id)
    server.should_exit = True
    thread.join(timeout=60)
    stop_cluster()
    ray.shutdown()


def test_completions_through_the_openai_client(served):
    """Not streamed and streamed: the token ids equal the Python client's for the same prompt,
    usage counts the prompt's and the output's tokens, and finish reasons are OpenAI's."""
    api = served.openai()
    extra = {"ignore_eos": True, "return_token_ids": True}
    expected = Client().generate([5, 6, 7], max_tokens=12, ignore_eos=True).token_ids
    done = api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=12, temperature=0, extra_body=extra)
    assert done.choices[0].model_extra["token_ids"] == expected
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (3, 12, 15)

    chunks = list(
        api.completions.create(
            model=MODEL, prompt=[[5, 6, 7]], max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
    )  # fmt: skip
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 3


def test_min_tokens_and_session_header_reach_the_replica(served):
    """min_tokens above max_tokens is refused naming it; `user` and the session header are accepted."""
    api = served.openai()
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=[1], max_tokens=2, extra_body={"min_tokens": 5})
    assert err.value.body["param"] == "min_tokens" and "at most max_tokens (2)" in err.value.body["message"]
    done = served.post(
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 2], "max_tokens": 3, "min_tokens": 3, "user": "alice"},
        headers={"x-session-id": "s1"},
    )
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3


ERROR_CASES = [
    # (body, status, param, words in the message)
    ({"model": MODEL, "prompt": [1], "temperature": -1}, 400, "temperature", ["greater than or equal to 0"]),
    ({"model": MODEL, "prompt": [1], "max_tokens": "many"}, 400, "max_tokens", ["valid integer", "'many'"]),
    ({"model": MODEL, "prompt": [1], "frobnicate": 1}, 400, "frobnicate", ["Unrecognized request argument"]),
    ({"model": MODEL, "prompt": [1], "n": 2}, 400, "n", ["n=2", "not supported"]),
    ({"model": MODEL, "prompt": [1], "logprobs": 1}, 400, "logprobs", ["not supported"]),
    ({"model": MODEL, "prompt": [[1], [2]]}, 400, "prompt", ["batch of 2 prompts"]),
    ({"model": MODEL, "prompt": "some text"}, 400, "prompt", ["no tokenizer", "token ids"]),
    ({"model": MODEL, "prompt": []}, 400, "prompt", ["empty"]),
    ({"model": MODEL, "prompt": [1, 5000]}, 400, "prompt", ["token ids must be in [0, 1000)", "5000"]),
    ({"model": MODEL, "prompt": [1] * 300}, 400, "prompt", ["maximum context length is 256", "316", "300 in"]),
    ({"model": MODEL, "prompt": [1], "max_tokens": 400}, 400, "max_tokens", ["256 tokens", "401 tokens"]),
    ({"model": "gpt-4", "prompt": [1]}, 404, "model", ["`gpt-4` does not exist", f"`{MODEL}`"]),
    ({"prompt": [1]}, 400, "model", ["Field required"]),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), ERROR_CASES)
def test_invalid_requests_get_openai_errors(served, body, status, param, words):
    """Each bad request gets its status and OpenAI's error shape, naming the field and the limit."""
    response = served.post("/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]


def test_chat_without_template_json_and_key_errors(served):
    """A fake model has no chat template; a body that is not JSON; a missing or wrong key is
    401 on every route but /health."""
    chat = served.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    bad_json = served.post("/v1/completions", "{not json")
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    for key in (None, "wrong"):
        response = served.post("/v1/completions", {"model": MODEL, "prompt": [1]}, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{served.url}{path}", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_models_health_and_metrics(served):
    """/v1/models names the model and its context; /health needs no key and lists the replicas;
    /metrics counts the requests answered."""
    assert [m.id for m in served.openai().models.list()] == [MODEL]
    health = httpx.get(f"{served.url}/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "router": "ok", "replica-0": "ok", "replica-1": "ok"}
    text = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'slotserve_http_requests_total{route="/v1/completions",status="200"}' in text


def test_overload_is_429_with_retry_after(served):
    """Past the replicas' bounded queues a request is refused at once with 429, OpenAI's error
    shape and a Retry-After header; the accepted ones all complete, and the cluster serves after."""

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 60, "ignore_eos": True}
            return await asyncio.gather(*[http.post(f"{served.url}/v1/completions", json=body) for _ in range(24)])

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in responses)
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert refused[0].json()["error"]["code"] == "overloaded" and "overloaded" in refused[0].json()["error"]["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in responses if r.status_code == 200)
    assert served.post("/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 2}).status_code == 200


def test_disconnected_stream_frees_its_slot(served):
    """A streaming client that hangs up after 3 chunks has its request aborted: the replicas
    run nothing within a few engine steps (10 ms each), and the store records it aborted."""
    body = {"model": MODEL, "prompt": [9, 9], "max_tokens": 250, "stream": True, "ignore_eos": True, "user": "gone"}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        with http.stream("POST", f"{served.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            chunks = []
            for line in lines:
                if line.startswith("data:"):
                    chunks.append(line)
                if len(chunks) == 3:
                    break
            assert served.running() == 1
    closed = time.monotonic()
    wait_until(lambda: served.running() == 0, 5, "the disconnected stream's slot", every=0.005)
    freed_after = time.monotonic() - closed
    assert freed_after < 0.5, freed_after
    print(f"slot freed {freed_after * 1000:.0f} ms after the disconnect")
    rows = _recorded(served, lambda r: r["session_id"] == "gone")
    assert len(rows) == 1 and rows[0]["finish_reason"] == "abort" and rows[0]["output_len"] < 250


def test_every_request_is_recorded_in_the_run(served):
    """An HTTP request lands in the serve run like a Python-client request: its id, replica,
    session, prompt and output lengths, and one time per token."""
    response = served.post("/v1/completions", {"model": MODEL, "prompt": [3, 4, 5, 6], "max_tokens": 7, "user": "bob"})
    request_id = response.json()["id"]
    (row,) = _recorded(served, lambda r: r["request_id"] == request_id)
    store = MetricsStore(served.store_path)
    assert (row["session_id"], row["prompt_len"], row["output_len"], row["finish_reason"]) == ("bob", 4, 7, "length")
    assert row["replica_id"] in ("replica-0", "replica-1") and row["first_token"] > row["arrival"]
    trace = next(t for t in store.traces(served.run_id) if t.request_id == request_id)
    assert len(trace.token_times) == 7
    assert store.run(served.run_id)["status"] == "running"


def test_serve_command_joins_the_cluster_and_closes_its_run(served, tmp_path):
    """`slotserve serve --address` joins the running cluster, takes its API key from
    SLOTSERVE_API_KEY, serves, and on SIGINT closes its run with the requests it answered."""
    port = free_port()
    env = {**os.environ, "SLOTSERVE_API_KEY": "env-key"}
    gcs = ray.get_runtime_context().gcs_address
    args = ["serve", "--address", gcs, "--port", str(port), "--served-model-name", MODEL, "--run-name", "cli"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 90, "`slotserve serve` to answer", every=0.2)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 4}
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer env-key"}).status_code == 200
        assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "joined the slotserve cluster" in output and "closed with 1 requests" in output
    run = next(r for r in MetricsStore(served.store_path).runs() if r["name"] == "cli")
    assert run["status"] == "complete"


def _rows(served: Served, keep: Callable[[dict], bool]) -> list[dict]:
    """The serve run's rows that `keep` picks, as recorded so far."""
    return [r for r in MetricsStore(served.store_path).requests(served.run_id) if keep(r)]


def _recorded(served: Served, keep: Callable[[dict], bool], at_least: int = 1) -> list[dict]:
    """The serve run's rows that `keep` picks, once there are `at_least` (the recorder sends
    its rows every second)."""

    def enough() -> list[dict] | None:
        rows = _rows(served, keep)
        return rows if len(rows) >= at_least else None

    return wait_until(enough, 10, f"{at_least} recorded row(s)")


def test_refused_bad_requests_are_recorded_invalid_with_their_status(served):
    """A bad sampling value (400), a body field OpenAI does not define (400, refused by the
    body's model) and another model's name (404) each become a row of the serve run ended
    `invalid`, its status in the error; an overload refusal stays `rejected` (429), so bad
    input never reads as overload."""
    before = {r["request_id"] for r in _rows(served, lambda r: r["finish_reason"] == "invalid")}
    bodies = [
        ({"model": MODEL, "prompt": [1], "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": [1], "frobnicate": 1}, 400, "frobnicate"),
        ({"model": "gpt-4", "prompt": [1]}, 404, "gpt-4"),
    ]
    for body, status, _ in bodies:
        assert served.post("/v1/completions", body).status_code == status
    rows = _recorded(served, lambda r: r["finish_reason"] == "invalid" and r["request_id"] not in before, 3)
    assert len(rows) == 3
    for row, (_, status, word) in zip(sorted(rows, key=lambda r: r["arrival"]), bodies):
        assert row["error"].startswith(f"HTTP {status}: ") and word in row["error"], row["error"]
        assert row["replica_id"] is None and row["output_len"] == 0
    rejected = _rows(served, lambda r: r["finish_reason"] == "rejected")
    assert all(r["error"].startswith("HTTP 429: ") for r in rejected)


def test_metrics_has_ttft_and_e2e_histograms(served):
    """/metrics has the ingress's time to first token and end-to-end latency as histograms
    by route, in the replicas' buckets: cumulative counts, one observation per answered
    request, and each request's end after its first token."""
    from prometheus_client.parser import text_string_to_metric_families

    from metrics.live import LATENCY_BUCKETS

    for stream in (False, True):
        body = {"model": MODEL, "prompt": [2, 3], "max_tokens": 5, "stream": stream}
        assert served.post("/v1/completions", body).status_code == 200
    text = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    answered = sum(
        s.value
        for s in families["slotserve_http_requests"].samples
        if s.name.endswith("_total") and s.labels == {"route": "/v1/completions", "status": "200"}
    )
    sums = {}
    for name in ("slotserve_http_time_to_first_token_seconds", "slotserve_http_e2e_request_latency_seconds"):
        samples = [s for s in families[name].samples if s.labels.get("route") == "/v1/completions"]
        buckets = [s for s in samples if s.name.endswith("_bucket")]
        assert [float(s.labels["le"]) for s in buckets] == [*LATENCY_BUCKETS, float("inf")]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and counts[-1] == answered >= 2
        sums[name] = next(s.value for s in samples if s.name.endswith("_sum"))
    assert 0 < sums["slotserve_http_time_to_first_token_seconds"] < sums["slotserve_http_e2e_request_latency_seconds"]
