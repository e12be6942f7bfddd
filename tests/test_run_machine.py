"""A run records the machine it ran on, its CPU named: machines of one kind differ (AVX2-only,
AVX-512 with BF16, AMX), so a figure read without its CPU can be read as another machine's."""

from __future__ import annotations

from experiments.experiment_report import machine_line
from metrics.store import MetricsStore
from protocol.cpu import cpu_info


def test_a_run_names_the_cpu_it_ran_on_and_its_report_shows_it(tmp_path):
    """The run's machine holds this CPU's model and the flags that change a matrix product, and
    an experiment report's machine line prints both, not just the architecture."""
    store = MetricsStore(tmp_path / "m.db")
    run = store.begin_run("r", {}, "chunked", "round_robin", 0)
    cpu = cpu_info()
    machine = store.run(run)["machine"]
    assert (machine["cpu"], machine["cpu_flags"]) == (cpu.model, cpu.shown_flags)
    assert f"{cpu.model} (flags: {cpu.shown_flags})" in machine_line(machine)


def test_a_run_recorded_before_cpus_were_named_reads_as_before():
    old = {"hostname": "vm", "processor": "x86_64", "cpus_usable": 2}
    assert machine_line(old) == "vm, x86_64, 2 usable CPUs, no GPU"
