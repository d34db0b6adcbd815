"""tests/bench in quick mode: the scaling benchmark runs end to end on the real code and renders a table,
and the page generator keeps the hand-written analysis. (`make bench` runs the full suite.)"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests.bench import __main__ as bench_main
from tests.bench import harness, scaling
from tests.bench.__main__ import ANALYSIS_MARKER, kept_analysis, render


def test_stats_and_tables():
    s = harness.Stats([3.0, 1.0, 2.0])
    assert s.median == 2.0 and s.fmt() == "2.00 (1.00-3.00)"
    assert harness.Stats([12345.6]).fmt() == "12,346"
    assert harness.ratio_stats([2.0, 9.0], [1.0, 3.0]).values == [2.0, 3.0]
    assert harness.table(["a", "b"], [[1, 2]]).splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_scaling_benchmark_quick(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(harness, "QUICK", True)
    monkeypatch.setattr(scaling, "QUICK", True)
    monkeypatch.setattr(scaling, "PROMPTS", 2)
    text = scaling.run(harness.Workspace(tmp_path))
    rows = [line for line in text.splitlines() if line.startswith("| group_size")]
    assert len(rows) == 2 and all(line.count("x") >= 4 for line in rows)


def test_page_keeps_the_hand_written_analysis(tmp_path: Path):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# old generated part\n\n{ANALYSIS_MARKER}\n\n## Analysis\n\nkept words\n")
    text = render([("T", "body", 1.0)], "make bench", 60.0, kept_analysis(page))
    assert "kept words" in text and "old generated part" not in text and "## T\n\nbody" in text
    assert text.count(ANALYSIS_MARKER) == 1


@pytest.mark.parametrize("missing", [True, False])
def test_page_without_analysis_gets_a_placeholder(tmp_path: Path, missing: bool):
    page = tmp_path / "benchmarks.md"
    if not missing:
        page.write_text("no marker here\n")
    assert kept_analysis(page).startswith(ANALYSIS_MARKER)


def _fake_benchmark(monkeypatch, name: str, run) -> None:
    module = types.ModuleType(f"tests.bench.fake_{name}")
    module.TITLE, module.run = f"Fake {name}", run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(bench_main.MODULES, name, module.__name__)


def _broken(ws):
    raise RuntimeError("this benchmark broke")


@pytest.mark.parametrize("broken", [True, False])
def test_a_failing_benchmark_fails_the_command_and_leaves_the_page(monkeypatch, tmp_path: Path, broken: bool):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"old page\n\n{ANALYSIS_MARKER}\n\nkept\n")
    _fake_benchmark(monkeypatch, "fine", lambda ws: "| a |\n|---|\n| 1 |")
    _fake_benchmark(monkeypatch, "broken", _broken if broken else (lambda ws: "fine too"))
    rc = bench_main.main(["fine", "broken", "--out", str(page)])
    failed = page.with_suffix(".failed.md")
    if broken:
        assert rc == 1 and page.read_text().startswith("old page")
        assert "this benchmark broke" in failed.read_text() and "## Fake fine" in failed.read_text()
    else:
        assert rc == 0 and not failed.exists()
        text = page.read_text()
        assert "## Fake broken\n\nfine too" in text and text.endswith("kept\n") and "at commit " in text
