"""Shared fixtures: small local Hugging Face model directories built from config with seeded
random weights (exercising the "local directory" loading path with no download), and the
default model loaded once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# Tests start and stop their own Ray instances (one per test, or one per module). Ray's
# auto-connect would let a stray call after `ray.shutdown()` (a client's feed thread still
# reading, say) silently join whatever cluster is still up and leak into the next test; turn it
# off before Ray is imported.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

from replica.model.linear import CROSSOVER_FILE  # noqa: E402
from replica.model.loader import cache_dir  # noqa: E402


def _cache_of_the_session() -> None:
    """Point `SLOTSERVE_CACHE` (which Ray's workers and the tests' subprocesses inherit) at a
    folder of the session's own, the user's cache linked into it entry by entry (the converted
    default model is not redone) except the crossovers (`replica.model.linear.crossover`): the
    suite measures those on a machine it keeps busy, and a user's engine must not read them.
    xdist's workers inherit the folder their controller made."""
    if os.environ.get("SLOTSERVE_TEST_CACHE"):
        return
    user, session = cache_dir(), Path(tempfile.mkdtemp(prefix="slotserve-test-cache-"))
    if user.is_dir():
        for entry in user.iterdir():
            if entry.name != CROSSOVER_FILE:
                (session / entry.name).symlink_to(entry)
    os.environ["SLOTSERVE_CACHE"] = os.environ["SLOTSERVE_TEST_CACHE"] = str(session)
    atexit.register(shutil.rmtree, session, ignore_errors=True)  # removes the links, not what they name


_cache_of_the_session()

TINY_VOCAB = 49152  # the default model's tokenizer, shipped with every tiny model dir

# `make test` runs the suite on two pytest-xdist workers (`-n 2`). Most of a cluster test's time
# is waiting on Ray (actor starts, health checks, drains), so the tests that need no cluster run
# on the other worker meanwhile. The modules named here start no Ray instance, server or cluster
# subprocess; every other module's tests are one unit of work that a single worker runs in file
# order, so module-scoped clusters are started once. A new module joins the first such unit until
# it is named here or in SECOND_CLUSTER_UNIT.
RUNS_BESIDE_CLUSTERS = frozenset(
    {
        "test_architecture",
        "test_autoscaler_states",
        "test_autoscaling",
        "test_autoscaling_experiment",
        "test_bad_input",
        "test_block_manager",
        "test_correctness",
        "test_disaggregation",
        "test_disaggregation_sim",
        "test_docs",
        "test_engine_speed_paths",
        "test_experiment_from_store",
        "test_flow_control",
        "test_flow_control_sim",
        "test_handover",
        "test_incremental_detokenize",
        "test_linear",
        "test_measured_pricing",
        "test_model_memory",
        "test_precise_prefix",
        "test_predicted_latency",
        "test_predicted_latency_queue",
        "test_protocol",
        "test_replica_priority",
        "test_reliability_serving",
        "test_router_fast_paths",
        "test_router_index",
        "test_routing_sim",
        "test_routing_work",
        "test_run_machine",
        "test_scheduler_invariants",
        "test_serving",
        "test_sim_records",
        "test_simulator",
        "test_slot_efficiency",
        "test_slot_queue",
        "test_slotserve_package",
        "test_split_routers",
        "test_store_backlog",
        "test_traces",
        "test_workloads_and_metrics",
    }
)


# The cluster modules whose tests start only in-process local Ray instances
# (`ray.init(address="local")`): no `ray start` and no `ray.cluster_utils.Cluster` (each writes the
# address file that `address="auto"` reads), no server on a fixed port, Ray Serve without its HTTP
# proxy. They are a second unit, on the other worker, so at most two clusters run at once and
# never two of the first unit's, which do start those; one unit alone would be the suite's length.
SECOND_CLUSTER_UNIT = frozenset(
    {
        "test_autoscaling_cluster",
        "test_disaggregation_cluster",
        "test_flow_control_cluster",
        "test_http_api_model",
        "test_ingress_scale_out",
        "test_reliability_model",
        "test_replica_speeds",
        "test_routing_cluster",
    }
)


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: itself, or one of the two cluster units."""
    module = Path(nodeid.split("::", 1)[0]).stem
    if module in RUNS_BESIDE_CLUSTERS:
        return nodeid
    return "clusters-b" if module in SECOND_CLUSTER_UNIT else "clusters"


# xdist's own `--dist loadgroup` would need an `xdist_group` mark on each test, but it carries the
# group in the test's id, which pytest 9.2 no longer lets it change (every test then runs on any
# worker, silently): this scheduler reads the unit off the id instead. tryfirst: before xdist's
# hook, which picks the scheduler `--dist` names.
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ClusterUnits(LoadScopeScheduling):
        """Every test beside the clusters is a unit of its own; the cluster tests, two units (the
        largest, so they are handed out first, one to each worker)."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ClusterUnits(config, log)


def _save_tiny(path, hf_model) -> str:
    from transformers import AutoTokenizer

    from replica.model.loader import default_model_dir

    hf_model.save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # A wide init makes the logits peaked, so greedy choices are not near-ties.
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=512, vocab_size=TINY_VOCAB, initializer_range=0.2)
    return _save_tiny(tmp_path_factory.mktemp("tiny-gpt2"), GPT2LMHeadModel(config).eval())


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # Qwen2 has Q/K/V biases; random ones make the test cover them
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.2)
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), model)
