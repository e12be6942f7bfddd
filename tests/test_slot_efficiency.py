"""Slot efficiency on `sigma-sweep` (flat-cost fake model, virtual clock): static batching's
measured efficiency equals the value computed from the workload alone, and continuous
batching wastes no row."""

from __future__ import annotations

import pytest

from benchmarks.slot_efficiency import main as slot_efficiency_script
from benchmarks.slot_efficiency import measure
from metrics.definitions import expected_static_slot_efficiency
from workloads.standard import SIGMAS, sigma_sweep


@pytest.mark.parametrize("sigma", SIGMAS)
def test_static_matches_expected_and_continuous_is_one(sigma):
    """For every sigma the static arm equals mean length / mean longest-per-batch to three
    decimals, and continuous is 1.00."""
    expected = expected_static_slot_efficiency(sigma_sweep(sigma).output_lens, 8)
    assert round(measure("static", sigma, 8, 48, 0), 3) == round(expected, 3)
    assert measure("continuous", sigma, 8, 48, 0) == 1.0
    if sigma > 0:
        assert expected < 0.9  # a spread of lengths really does waste static rows


def test_expected_static_efficiency_formula():
    """Batches in arrival order: [1, 3] and [2, 2] -> mean 2 / mean(3, 2)."""
    assert expected_static_slot_efficiency([1, 3, 2, 2], 2) == pytest.approx(2 / 2.5)


def test_script_prints_every_sigma(capsys):
    """The script behind the README's table prints one row per sigma with all three columns."""
    rows = slot_efficiency_script([])
    out = capsys.readouterr().out
    assert [r["sigma"] for r in rows] == list(SIGMAS)
    assert all(f"{r['static']:.3f}" in out for r in rows)
