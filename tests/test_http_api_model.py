"""The HTTP API on the real default model (one replica on a local Ray cluster), through the
official `openai` package: greedy output token-equal to the Python client's, chat with the
model's template, usage counts from the real tokenizer, stop strings and min_tokens."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
import ray

from cluster.client import Client
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from cluster.http.server import build_ingress, http_server, load_tokenizer, serve_http
from replica import EngineConfig
from replica.serving.loop import ReplicaConfig
from tests.test_http_api import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    ray.init(address="local", num_cpus=2, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    replica = ReplicaConfig(engine=EngineConfig(num_slots=4, max_seq_len=512))
    deployment = start_cluster(
        ClusterSpec(num_replicas=1, replica=replica, store_path=str(tmp_path_factory.mktemp("m") / "s.db"))
    )
    ingress = build_ingress(deployment)
    port = free_port()
    server = http_server(ingress, "127.0.0.1", port, None)
    thread = threading.Thread(target=asyncio.run, args=(serve_http(ingress, server),), daemon=True)
    thread.start()
    wait_until(lambda: server.started, 60, "the HTTP server to start")
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(timeout=60)
    stop_cluster()
    ray.shutdown()


def test_greedy_completion_equals_the_python_client(api):
    """Same prompt, greedy: the HTTP answer's token ids and text equal the Python client's,
    streamed or not, and prompt_tokens is the tokenizer's count."""
    expected = Client().generate(PROMPT, max_tokens=24, temperature=0.0)
    extra = {"return_token_ids": True}
    done = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra)
    assert done.choices[0].model_extra["token_ids"] == expected.token_ids
    assert done.choices[0].text == expected.text
    assert done.usage.prompt_tokens == len(load_tokenizer(MODEL).encode(PROMPT, add_special_tokens=False))
    assert done.usage.completion_tokens == len(expected.token_ids)
    stream = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected.text


def test_stop_string_is_honoured(api):
    """A stop string spanning tokens cuts the text before it and ends the request with
    finish_reason stop; streamed, no part of it leaks out before it completes."""
    full = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = " ".join(full.split()[2:4])
    params = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    cut = api.completions.create(**params).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    chunks = [c.choices[0] for c in api.completions.create(**params, stream=True)]
    assert "".join(c.text for c in chunks) == cut.text and chunks[-1].finish_reason == "stop"


def test_chat_uses_the_template_and_counts_usage(api):
    """Chat applies the model's template (prompt_tokens is the templated prompt's length); the
    streamed answer equals the whole one, and the usage chunk counts the streamed tokens."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
    tokenizer = load_tokenizer(MODEL)
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    done = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    answer = done.choices[0].message
    assert answer.role == "assistant" and answer.content
    assert done.usage.prompt_tokens == len(tokenizer.encode(templated, add_special_tokens=False))
    chunks = list(
        api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.content
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_min_tokens_holds_back_eos(api):
    """An answer that ends at EOS runs past that point when min_tokens asks for more (EOS is
    masked until then), as vLLM's min_tokens does."""
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]
    short = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0)
    made = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and made < 70
    held = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=80, temperature=0, extra_body={"min_tokens": made + 8}
    )
    assert held.usage.completion_tokens >= made + 8
