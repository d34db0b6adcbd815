"""tests/bench in quick mode: the scaling benchmark runs end to end on the real code and renders a table; the
page keeps the hand-written analysis and the other command's region; the runner, as a real command in quick
mode, fails on a failing module and leaves the page. (`make bench-quick` runs every module's quick mode.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import __main__ as bench_main
from tests.bench import harness, page, scaling


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


def _region(label: str, body: str) -> str:
    run = page.Run(label, 90.0, (1.0, 2.0, 3.0), (1.5, 2.5, 3.5), {"CPU": "a test CPU", "commit": "abc1234"})
    return page.render_region(label, [(f"T {body}", body, 1.0)], run)


def test_each_command_rewrites_only_its_region_and_the_analysis_is_kept():
    old = f"# old generated part, no markers\n\n{page.ANALYSIS_MARKER}\n\n## Analysis\n\nkept words\n"
    text = page.update(old, "make bench-long", _region("make bench-long", "long one"))
    text = page.update(text, "make bench", _region("make bench", "main one"))
    text = page.update(text, "make bench-long", _region("make bench-long", "long two"))
    assert "old generated part" not in text and text.endswith("kept words\n")
    assert text.count(page.ANALYSIS_MARKER) == 1 and "long one" not in text
    assert text.index("## T main one") < text.index("## T long two") < text.index(page.ANALYSIS_MARKER)
    assert list(page.regions(text)) == ["make bench", "make bench-long"]
    head = page.regions(text)["make bench"].splitlines()[2]
    assert head.startswith("**`make bench`** at commit abc1234: ") and "1.5 min" in head
    assert "1.00 / 2.00 / 3.00 at start" in head and "1.50 / 2.50 / 3.50 at the end" in head
    assert "| CPU | a test CPU |" in page.regions(text)["make bench"]


@pytest.mark.parametrize("missing", [True, False])
def test_page_without_analysis_gets_a_placeholder(missing: bool):
    assert page.kept_analysis(None if missing else "no marker here\n").startswith(page.ANALYSIS_MARKER)


@pytest.mark.parametrize(
    "argv",
    [["--quick"], ["scaling"], ["--long", "backends"], ["algorithms", "--out", "/tmp/x.md"], ["--every"]],
)
def test_the_page_takes_only_whole_full_runs_and_tools_run_only_quick(argv: list[str]):
    with pytest.raises(SystemExit) as exc:
        bench_main._parse(argv)
    assert exc.value.code == 2


FAKES = {
    "fine": "TITLE = 'Fake fine'\ndef run(ws):\n    return '| a |\\n|---|\\n| 1 |'\n",
    "broken": "TITLE = 'Fake broken'\ndef run(ws):\n    raise RuntimeError('this benchmark broke')\n",
    "also_fine": "TITLE = 'Fake also fine'\ndef run(ws):\n    return 'fine too'\n",
}


def _fakes(tmp_path: Path) -> Path:
    """A package of fake benchmark modules outside the checkout, and a page with a hand-written part."""
    (tmp_path / "benchfakes").mkdir()
    (tmp_path / "benchfakes" / "__init__.py").write_text("")
    for name, source in FAKES.items():
        (tmp_path / "benchfakes" / f"{name}.py").write_text(source)
    out = tmp_path / "page.md"
    out.write_text(f"old page\n\n{page.ANALYSIS_MARKER}\n\nkept\n")
    return out


def test_the_command_fails_on_a_failing_module_in_quick_mode(tmp_path: Path):
    """`python -m tests.bench --quick` as CI runs it, a real process: exit 1, the page left, the traceback shown."""
    out = _fakes(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(harness.ROOT), str(tmp_path)])}
    argv = [sys.executable, "-m", "tests.bench", "--quick", "benchfakes.fine", "benchfakes.broken", "--out", str(out)]
    proc = subprocess.run(argv, env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=300)
    failed = out.with_suffix(".failed.md").read_text()
    assert proc.returncode == 1 and out.read_text().startswith("old page"), proc.stdout + proc.stderr
    assert "this benchmark broke" in proc.stderr and "this benchmark broke" in failed and "## Fake fine" in failed
    assert "at commit " in failed and "quick mode" in failed and failed.endswith("kept\n")


def test_a_passing_run_writes_its_region(monkeypatch, tmp_path: Path):
    out = _fakes(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(harness, "QUICK", False)
    monkeypatch.setenv("ROLLFLOW_BENCH_QUICK", "0")
    assert bench_main.main(["benchfakes.fine", "benchfakes.also_fine", "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Fake also fine\n\nfine too" in text and text.endswith("kept\n") and "old page" not in text
    assert "at commit " in text and "load average" in text and not out.with_suffix(".failed.md").exists()
