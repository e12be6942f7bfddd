"""Property-based fuzzing of a running cluster: hypothesis generates 300 malformed requests
(wrong types, missing or unknown fields, huge, negative, NaN and inf numbers, lone surrogates,
token ids out of the vocabulary, prompts past the context) and sends each both through the
client and straight to a replica actor (skipping the client's checks), while well-formed
requests stream beside them. Every bad one gets an InvalidRequestError naming the field, no
replica dies or restarts, and every good one completes with exactly the right tokens."""

from __future__ import annotations

import math
import threading

import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.client import Client
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from replica import EngineConfig, InvalidRequestError
from replica.model.fake import ScriptedFakeRunner
from replica.serving.loop import ReplicaConfig

FAKE = ScriptedFakeRunner(None)  # what an undisturbed run of the fake model makes: FAKE.continuation

VOCAB = 1000  # the fake model's
GOOD_PARAMS = {"max_tokens": 4, "ignore_eos": True}

huge = st.integers(min_value=2**64, max_value=2**200)
not_finite = st.sampled_from([math.nan, math.inf, -math.inf])
not_null = st.one_of(st.text(max_size=5), st.binary(max_size=5), st.dictionaries(st.text(max_size=3), st.none()))
junk = st.none() | not_null
CLIENT_ARGUMENTS = {"prompt", "session_id", "request_id", "timeout", "self"}

# (field the error must name, prompt, params)
bad_prompts = st.one_of(
    st.lists(st.integers(min_value=VOCAB, max_value=2**70), min_size=1, max_size=4),  # out of vocabulary
    st.lists(st.integers(max_value=-1), min_size=1, max_size=4),
    st.lists(st.booleans(), min_size=1, max_size=4),
    st.lists(st.floats(allow_nan=True), min_size=1, max_size=4),
    st.just([]),
    st.integers() | st.floats() | st.none() | st.binary(max_size=8),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=4),  # lone surrogates (undecodable bytes)
    st.just(list(range(1, 301))),  # past the 256-token context
).map(lambda p: ("prompt", p, GOOD_PARAMS))

bad_values = {
    "max_tokens": st.one_of(st.integers(max_value=0), huge, st.floats(), not_finite, junk, st.booleans()),
    "temperature": st.one_of(st.floats(max_value=-1e-9), not_finite, junk),
    "top_p": st.one_of(st.floats(min_value=1.0001), st.floats(max_value=0.0), not_finite, junk),
    "top_k": st.one_of(st.integers(max_value=-1), st.floats(), junk),
    "seed": st.one_of(huge, st.integers(max_value=-1), st.floats(), not_null),  # None is a valid seed
    "stop": st.one_of(st.just(""), st.lists(st.integers(), min_size=1), st.just([""]), st.integers()),
    "stop_token_ids": st.one_of(st.lists(st.text(max_size=3), min_size=1), st.text(min_size=1), st.floats()),
    "ignore_eos": st.one_of(st.text(min_size=1), st.integers(min_value=2), st.floats()),
}
bad_params = st.one_of(
    *[
        values.map(lambda v, name=name: (name, [1, 2, 3], {**GOOD_PARAMS, name: v}))
        for name, values in bad_values.items()
    ],
    st.text(min_size=1, max_size=12)
    .filter(lambda k: k not in bad_values and k not in CLIENT_ARGUMENTS and k.isidentifier())
    .map(lambda k: (k, [1, 2, 3], {**GOOD_PARAMS, k: 1})),
)
bad_requests = st.one_of(bad_prompts, bad_params)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    ray.init(address="local", num_cpus=2, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    replica = ReplicaConfig(engine=EngineConfig(num_slots=4, max_seq_len=256), fake_step_seconds=0.005)
    path = tmp_path_factory.mktemp("fuzz") / "s.db"
    deployment = start_cluster(ClusterSpec(num_replicas=2, replica=replica, store_path=str(path)))
    pids = {rid: ray.get(h.info.remote()).pid for rid, h in deployment.replicas.items()}
    client = Client()
    good = {"done": 0, "wrong": [], "stop": threading.Event()}

    def good_traffic():
        with Client() as beside:
            i = 0
            while not good["stop"].is_set():
                prompt = [i % 900 + 1, 7]
                result = beside.generate(prompt, max_tokens=6, ignore_eos=True)
                if result.token_ids != FAKE.continuation(prompt, 6) or result.finish_reason != "length":
                    good["wrong"].append((prompt, result.token_ids, result.error))
                good["done"] += 1
                i += 1

    thread = threading.Thread(target=good_traffic, daemon=True)
    thread.start()
    yield deployment, client, good
    good["stop"].set()
    thread.join(timeout=60)
    assert good["done"] >= 20 and not good["wrong"], good["wrong"][:3]
    assert {rid: ray.get(h.info.remote()).pid for rid, h in deployment.replicas.items()} == pids  # none died
    assert all(ray.get(h.health.remote()).healthy for h in deployment.replicas.values())
    client.close()
    stop_cluster()
    ray.shutdown()


@pytest.mark.timeout(600)
@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(bad=bad_requests, raw_subscriber=st.one_of(st.just("fuzz"), junk, st.integers()))
def test_every_malformed_request_is_a_clear_error_and_nothing_else_breaks(running, bad, raw_subscriber):
    deployment, client, _ = running
    field, prompt, params = bad
    with pytest.raises(InvalidRequestError) as err:
        client.generate(prompt, **params)
    assert err.value.field.split(".")[0] == field, str(err.value)

    # The same straight at a replica, skipping the client (and, sometimes, a junk subscriber).
    replica = deployment.replicas["replica-0"]
    with pytest.raises(ray.exceptions.RayTaskError) as raw:
        ray.get(replica.submit.remote(raw_subscriber, prompt, params, "raw-fuzz", None), timeout=60)
    cause = raw.value.cause
    assert isinstance(cause, InvalidRequestError), repr(cause)
    assert cause.field.split(".")[0] == field or (cause.field == "subscriber" and raw_subscriber != "fuzz"), str(cause)
