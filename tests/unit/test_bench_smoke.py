"""tests/bench in quick mode: the scaling benchmark runs end to end on the real code and renders a table,
and the page generator keeps the hand-written analysis. (`make bench` runs the full suite.)"""

from __future__ import annotations

from pathlib import Path

import pytest

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
