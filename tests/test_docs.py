"""The README is a front door and the documentation site cannot go stale: every page is in the
site's navigation and reachable from the README, the generated reference pages and results
tables equal what `docs/generate.py` makes from the code and the committed results now, every
measured table has a source (a generated block) or says when and where it was measured (a
historical block), and every shipped experiment report is current or listed as historical."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from docs import generate

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# Pages that are whole reports written by a benchmark, beside the JSON of the same run.
REPORT_PAGES = {"fidelity.md": "fidelity.json"}
MEASURED = re.compile(r"\d\.\d|\d%")  # a decimal figure or a percentage
REGION = re.compile(r"<!-- (generated: [^>]*|historical: [^>]*) -->\n.*?<!-- end (generated|historical) -->", re.S)
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None and text.index(first_block.group(0)) < text.index("\n## ")
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make run", "make test"]


def test_the_tour_exports_the_metrics_interval_before_ray_starts() -> None:
    text = README.read_text()
    assert text.index("export RAY_metrics_report_interval_ms=1000") < text.index("ray start --head")


def test_every_docs_page_is_in_the_nav_and_reachable_from_the_readme() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    nav = nav_pages(config["nav"])
    assert sorted(nav) == sorted(p.relative_to(DOCS).as_posix() for p in doc_pages())
    from_readme = {(ROOT / link).resolve() for link in LINK.findall(README.read_text())}
    index = DOCS / "index.md"
    assert index.resolve() in from_readme
    from_index = {(DOCS / link).resolve() for link in LINK.findall(index.read_text())}
    missing = [page for page in nav if (DOCS / page).resolve() not in from_readme | from_index | {index.resolve()}]
    assert not missing, f"not linked from the README or docs/index.md: {missing}"


def test_no_page_points_at_the_developers_folder() -> None:
    for path in [README, *doc_pages()]:
        text = path.read_text()
        assert "../shared" not in text and "/work/shared" not in text, path


@pytest.mark.parametrize("page", generate.pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_generated_pages_and_tables_match_their_sources(page: Path) -> None:
    """Fails when a reference page or a results block is not what the code and the committed
    results make now: run `make docs` (`.venv/bin/python docs/generate.py`)."""
    assert page.exists(), f"{page} is missing: run `make docs`"
    assert page.read_text() == generate.expected(page), f"{page} is out of date: run `make docs`"


def test_a_results_block_is_rendered_from_its_source(tmp_path: Path) -> None:
    """Changing a figure in the source changes the table; changing it in the page alone is undone."""
    source = json.loads((DOCS / "kv_memory.json").read_text())
    before = generate.kv_memory(DOCS / "kv_memory.json")
    source["rows"][0]["throughput"] += 100.0
    (tmp_path / "kv.json").write_text(json.dumps(source))
    assert generate.kv_memory(tmp_path / "kv.json") != before

    page = (DOCS / "performance.md").read_text()
    block = re.search(r"<!-- generated: kv-memory from \S+ -->\n.*?<!-- end generated -->", page, re.S).group(0)
    tampered = page.replace(block, block.replace("9.7%", "8.7%"))
    assert tampered != page
    assert generate.render_blocks(tampered) == page


def test_the_twin_order_block_ranks_both_sides_and_correlates_them(tmp_path: Path) -> None:
    """Three policies' TTFT p90 on real replicas (1, 2, 3 s) and on the twin (1, 3, 2 s): each
    side's ranks, and a Spearman of 0.5 (one adjacent swap in three); a policy one side lacks is
    left out."""

    def report(name: str, p90: dict[str, str]) -> Path:
        rows = "\n".join(f"| chunked | {k} | {v} |" for k, v in p90.items())
        text = (
            f"# {name}\n\nMade by `slotserve experiment {name}.toml` on 2026-12-02, commit `abc`.\n\n"
            "- Machine: vm\n- Cluster: 2 replicas, fake model\n\n"
            f"## Results\n\n| batching | routing | TTFT p90 s |\n|---|---|---:|\n{rows}\n\n## Runs\n"
        )
        path = tmp_path / f"{name}.md"
        path.write_text(text)
        return path

    real = report("real", {"a": "1.000 ±0.1", "b": "2.000 ±0.1", "c": "3.000 ±0.1", "d": "4.000 ±0.1"})
    twin = report("twin", {"a": "1.000 ±0.1", "b": "3.000 ±0.1", "c": "2.000 ±0.1"})
    block = generate.ttft_order(twin, real)
    assert "| b | 2.000 | 2 | 3.000 | 3 |" in block and "| d |" not in block
    assert block.endswith("across the 3 routing policies: 0.50.")


def test_every_measured_table_has_a_source_or_a_date() -> None:
    """A table row with a decimal figure or a percentage sits in a generated block (rendered
    from a committed file) or a historical one naming the machine and the date."""
    for page in doc_pages():
        rel = page.relative_to(DOCS).as_posix()
        if rel in REPORT_PAGES or rel in generate.PAGES:
            continue
        text = page.read_text()
        for region in REGION.finditer(text):
            if region.group(1).startswith("historical"):
                assert re.search(r"\d{4}-\d{2}-\d{2}", region.group(1)), f"{rel}: a historical block without a date"
        outside = REGION.sub("", text)
        rows = [line for line in outside.splitlines() if line.startswith("|") and MEASURED.search(line)]
        assert not rows, f"{rel}: measured table rows with no source or date: {rows[:3]}"


def test_every_shipped_report_is_current_or_listed_as_historical() -> None:
    """A simulated report is current when it names the cost model class this code simulates
    its file with; any other report (a Ray cluster's measurement) must read as historical on the
    experiments page, with why."""
    page = (DOCS / "experiments.md").read_text()
    reports = sorted((ROOT / "workloads" / "experiments").glob("*/report.md"))
    assert reports
    for report in reports:
        header = generate.report_header(report)
        rel = report.relative_to(ROOT).as_posix()
        row = next((line for line in page.splitlines() if f"`{rel}`" in line), None)
        assert row is not None, f"{rel} is not listed on docs/experiments.md"
        current = header["simulated"] and header["cost_model"] == generate.current_cost_model(header["toml"])
        if current:
            assert "| current:" in row, row
        else:
            assert "| historical:" in row and len(row.split("| historical:")[1].strip()) > 20, row


def test_report_pages_belong_to_their_json() -> None:
    for page, source in REPORT_PAGES.items():
        commit = json.loads((DOCS / source).read_text())["git_commit"]
        assert f"commit `{commit}`" in (DOCS / page).read_text()


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """A broken link, a missing anchor or a page left out of the nav fails the build."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
