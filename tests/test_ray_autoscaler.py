"""Ray's autoscaler under slotserve's: on Ray's fake multi-node provider (the provider behind
`ray.cluster_utils.AutoscalingCluster`), a replica that fits on no node makes Ray add one, and a
node left idle after the autoscaling controller drains its replica is removed again.

`AutoscalingCluster` itself is not used: its `start()` and `shutdown()` run `ray stop --force`,
which stops every Ray instance on the machine (anyone else's included), and this Ray's wheel
lacks the `fake_multi_node/example.yaml` its constructor reads. The cluster is started here the
way `AutoscalingCluster.start()` starts it (`ray start --head --autoscaling-config` with
`RAY_FAKE_CLUSTER=1`), on a port and a temp dir of its own, and stopped by ending exactly the
processes that carry that temp dir. The head has no CPU, so every replica (1 CPU) needs a node
Ray adds; the node type has a custom resource too, which the replicas do not ask for."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray

from autoscaling.policies import AutoscaleConfig
from cluster.autoscaler import autoscaler_status
from cluster.client import Client
from cluster.connection import ClusterError
from cluster.deploy import ClusterSpec, check_resources, ray_autoscaler_limits, start_cluster, stop_cluster
from replica.config import EngineConfig
from replica.serving.loop import ReplicaConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

NODE_TYPE = "slotserve.replica-node"
MAX_NODES = 2
IDLE_TIMEOUT_MINUTES = 0.1  # Ray removes a node idle for 6 s
START_TIMEOUT = 600  # a node is a raylet and its workers started on two shared cores

CONFIG = {
    "cluster_name": "slotserve-fake",
    "max_workers": MAX_NODES,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True},
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
        NODE_TYPE: {
            "resources": {"CPU": 1, "replica_node": 1, "object_store_memory": 100 * 2**20},
            "node_config": {},
            "min_workers": 0,
            "max_workers": MAX_NODES,
        },
    },
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_under(marker: str) -> list[int]:
    """Ids of the processes whose command line names `marker` (this test's temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _end(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL whatever has not ended within 3 s: some of a fake cluster's
    processes outlast even 10 s of SIGTERM, and the temp dir they used is removed after."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            wait_until(
                lambda: not any(Path(f"/proc/{p}").exists() for p in pids), timeout=3, what="the processes to end"
            )
            return
        except TimeoutError:
            pass


@pytest.fixture
def fake_autoscaling_cluster():
    """A head node with Ray's autoscaler on the fake multi-node provider; yields its address."""
    temp_dir = tempfile.mkdtemp(prefix="ssas-", dir="/tmp")  # short: Ray's socket paths must stay short
    port = _free_port()
    config = {**CONFIG, "provider": {**CONFIG["provider"], "gcs_address": f"127.0.0.1:{port}"}}
    config_path = Path(temp_dir) / "autoscaling.json"
    config_path.write_text(json.dumps(config))
    ray_cli = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    command = [ray_cli, "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", "--num-cpus=0"]
    command += [f"--autoscaling-config={config_path}", "--disable-usage-stats", "--include-dashboard=false"]
    command += ["--node-ip-address=127.0.0.1"]
    try:
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=180)
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            stop_cluster()
            ray.shutdown()
        _end(_processes_under(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


def _spec(tmp_path, replicas: int = 1, autoscaled: bool = True) -> ClusterSpec:
    autoscale = AutoscaleConfig(
        policy="target_ongoing",
        min_replicas=1,
        max_replicas=2,
        cooldown_s=2,
        period_s=0.5,
        drain_timeout_s=5,
        params={"target_ongoing_requests": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 3, "look_back_s": 1},
    )
    return ClusterSpec(
        num_replicas=replicas,
        replica=ReplicaConfig(engine=EngineConfig(num_slots=2, max_seq_len=256), fake_step_seconds=0.05),
        num_cpus_per_replica=1,
        store_path=str(tmp_path / "s.db"),
        health_period=0.25,
        autoscale=autoscale if autoscaled else None,
    )


def test_ray_adds_a_node_for_a_replica_and_removes_it_once_drained(fake_autoscaling_cluster, tmp_path):
    from cluster.connection import connect

    connect(fake_autoscaling_cluster)
    assert ray.cluster_resources().get("CPU", 0) == 0  # the head has none: every replica needs a node
    # The monitor reports the head's node type a moment after the head is up.
    wait_until(lambda: ray_autoscaler_limits() is not None, timeout=START_TIMEOUT, what="the autoscaler's node types")
    limits = ray_autoscaler_limits()

    print(f"Ray's autoscaler limits: {limits}")
    check_resources(_spec(tmp_path, replicas=MAX_NODES, autoscaled=False))  # what Ray can add is not refused
    if limits:  # Ray tells what its autoscaler can bring up: more than that is refused at once, naming it
        with pytest.raises(ClusterError, match="autoscaler"):
            check_resources(_spec(tmp_path, replicas=MAX_NODES + 1, autoscaled=False))

    start_cluster(_spec(tmp_path))  # replica-0 fits on no node: Ray adds one (start_cluster waits for it)
    assert len(_alive_nodes()) == 2
    assert autoscaler_status().replicas[0].state == "serving"

    async def load_until_a_replica_is_added(client: Client) -> None:
        """12 requests in flight on 2 slots, each followed by another, until the replica the
        controller asks for serves (its cold start includes the start of the node Ray adds)."""
        added = asyncio.ensure_future(
            asyncio.to_thread(
                wait_until, lambda: autoscaler_status().cold_starts, START_TIMEOUT, "the added replica to serve", 0.5
            )
        )

        async def stream() -> None:
            while not added.done():
                await client.agenerate([1, 2, 3], max_tokens=10, ignore_eos=True)

        await asyncio.gather(added, *[stream() for _ in range(12)])

    with Client() as client:
        asyncio.run(load_until_a_replica_is_added(client))  # the controller asks for replica-1
    status = autoscaler_status()
    assert status.scale_ups >= 1 and status.cold_starts, status
    # Ray added a second node for replica-1 (its cold start includes the node's start)
    wait_until(lambda: len({n["NodeID"] for n in ray.nodes()}) >= 3, timeout=START_TIMEOUT, what="a second node")

    # idle: the controller drains back to min, and Ray removes the node left with nothing on it
    wait_until(lambda: len(autoscaler_status().replicas) == 1, timeout=START_TIMEOUT, what="a drain back to 1")
    wait_until(lambda: len(_alive_nodes()) == 2, timeout=START_TIMEOUT, what="the idle node removed")
    assert autoscaler_status().scale_downs >= 1
