"""`slotserve experiment FILE --from-store`: a report written from the runs a store already
holds for a file's cells (a file run in pieces, one seed at a time), without running any."""

from __future__ import annotations

from cli.main import main
from metrics.store import MetricsStore
from tests.test_experiment import EXPERIMENT, write


def test_a_report_is_written_again_from_cells_run_in_pieces(tmp_path, capsys):
    """--from-store runs nothing: a file's cells run one seed at a time into one store report
    as the whole file run at once does (the same table, from the runs already there); a cell
    without a complete run is named and left out; a store holding none of the file's runs of
    the kind asked for (cluster runs, where only simulated ones are there) is refused by name."""
    text = EXPERIMENT.replace('["static", "continuous"]', '["continuous"]')
    path = write(tmp_path, text)
    whole, pieces = tmp_path / "whole.db", tmp_path / "pieces.db"

    def table(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.startswith("continuous")]

    assert main(["experiment", str(path), "--simulate", "--store", str(whole), "--out", str(tmp_path / "w")]) == 0
    expected = table(capsys.readouterr().out)
    assert len(expected) == 2
    for seed in ("0", "1"):
        args = ["--store", str(pieces), "--seeds", seed, "--out", str(tmp_path / "p")]
        assert main(["experiment", str(path), "--simulate", *args]) == 0
    capsys.readouterr()
    ran = len(MetricsStore(pieces).runs())

    again = tmp_path / "again"
    collect = ["--simulate", "--store", str(pieces), "--from-store", "--out", str(again)]
    assert main(["experiment", str(path), *collect]) == 0
    out = capsys.readouterr().out
    assert table(out) == expected and "left out" not in out
    assert len(MetricsStore(pieces).runs()) == ran
    report = (again / "report.md").read_text()
    assert f"Written by `slotserve experiment {path} --simulate --from-store --store {pieces} --out {again}`" in report

    wider = write(tmp_path, text.replace("load = [0.5, 1.0]", "load = [0.5, 1.0, 1.5]"), "wider.toml")
    assert main(["experiment", str(wider), *collect]) == 0
    out = capsys.readouterr().out
    assert "2 of 6 cells have no complete simulated run" in out
    assert out.count("left out: continuous/least_loaded load=1.5") == 2 and len(table(out)) == 2

    assert main(["experiment", str(path), "--store", str(pieces), "--from-store"]) == 2
    assert "holds no complete cluster run" in capsys.readouterr().err
    assert main(["experiment", str(path), "--simulate", "--store", str(tmp_path / "none.db"), "--from-store"]) == 2
    assert "no store at" in capsys.readouterr().err
