"""slotserve: a multi-replica LLM serving cluster on Ray, built so that batching and routing
policies can be compared on the same traffic with nothing else changing.

The user's API, from the packages that implement it:

- one engine in this process: `Engine(EngineConfig(...)).generate(prompts, SamplingParams(...))`;
- a cluster: `start_cluster(ClusterSpec(...))` from Python (what `slotserve up` starts) and
  `stop_cluster()`, and `Client()` to send it requests (sync, async and streaming; temperature 0,
  greedy, unless a request says otherwise);
- experiments: `plan_experiment(file)` checks an experiment file, `run_experiment(plan)` runs it
  (on a Ray cluster, or with `simulate=True` in the simulator), `summarize_runs` and
  `format_summary` give its table, `write_report` its report.md and plots, and `MetricsStore`
  with `analyze` reads any recorded run.
"""

from cluster.client import Client
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from experiments.experiment_report import format_summary, summarize_runs, write_report
from experiments.plan import plan_experiment
from experiments.run import run_experiment
from metrics.definitions import SLO
from metrics.goodput_report import analyze
from metrics.store import MetricsStore
from replica.config import EngineConfig
from replica.engine import Engine
from replica.scheduling.request import SamplingParams
from replica.serving.loop import ReplicaConfig

__all__ = [
    "SLO",
    "Client",
    "ClusterSpec",
    "Engine",
    "EngineConfig",
    "MetricsStore",
    "ReplicaConfig",
    "SamplingParams",
    "analyze",
    "format_summary",
    "plan_experiment",
    "run_experiment",
    "start_cluster",
    "stop_cluster",
    "summarize_runs",
    "write_report",
]
