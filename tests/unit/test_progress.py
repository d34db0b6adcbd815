"""What a person sees of a run's metrics: the curve tables, downsampling and sparklines of the summary
artifact (runtime/curves.py, runtime/summary.py), the live progress view and its polling watcher
(runtime/progress.py over a real metrics.jsonl), with rows that carry only held-out evaluation keys.
"""

from __future__ import annotations

import json
import logging
import math
import time

import pytest

from runtime.curves import BARS, MAX_ROWS, curves_markdown, curves_table, downsample, run_curves, sparkline
from runtime.progress import MetricsWatcher, progress_view
from runtime.summary import summarize, to_markdown
from storage.fs import get_fs
from storage.metrics import MetricsFollower, MetricsLog, eval_curve_keys, metric_curve


def _rows(steps: int, eval_every: int = 0) -> list[dict]:
    """Trainer rows 1..steps with reward = step / 100; with `eval_every`, evaluation keys merged into every
    eval_every-th step and a row of version 0 that carries evaluation keys only."""
    rows = [{"step": s, "reward_mean": s / 100, "mismatch_kl": 1e-9, "loss": 0.1} for s in range(1, steps + 1)]
    if eval_every:
        ev = {"eval/reward_mean": 0.05, "eval/rev/reward_mean": 0.04, "eval/rev/pass@4": 0.2, "eval/samples": 64}
        rows.insert(0, {"step": 0, **ev})
        for r in rows[eval_every::eval_every]:
            r.update({k: v + r["step"] / 1000 for k, v in ev.items() if k != "eval/samples"})
    return rows


def test_downsample_keeps_first_last_and_even_spacing():
    points = list(range(1, 1001))
    picked = downsample(points)
    assert len(picked) == MAX_ROWS and picked[0] == 1 and picked[-1] == 1000
    gaps = {b - a for a, b in zip(picked, picked[1:], strict=False)}
    assert gaps <= {20, 21}  # 999 / 49 = 20.4
    assert downsample(points[:50]) == points[:50]
    with pytest.raises(ValueError, match="max_points must be >= 2"):
        downsample(points, 1)


def test_sparkline_scales_between_min_and_max_and_buckets_long_curves():
    assert sparkline([0.0, 0.5, 1.0]) == BARS[0] + BARS[4] + BARS[7]  # 0.5 * 7 = 3.5 rounds to 4
    assert sparkline([0.3, 0.3]) == BARS[3] * 2
    assert sparkline([]) == ""
    long = sparkline([float(i) for i in range(600)], width=60)
    assert len(long) == 60 and long[0] == BARS[0] and long[-1] == BARS[-1]
    assert list(long) == sorted(long)  # a rising curve never dips after bucket means


def test_curves_skip_rows_without_the_key_and_non_numbers():
    rows = _rows(3, eval_every=2)
    rows.append({"step": 4, "reward_mean": math.nan})
    rows.append({"step": 5, "reward_mean": True})
    assert metric_curve(rows, "reward_mean") == [(1, 0.01), (2, 0.02), (3, 0.03)]
    assert eval_curve_keys(rows) == ["eval/reward_mean", "eval/rev/pass@4", "eval/rev/reward_mean"]
    assert run_curves(rows)["eval/reward_mean"] == [(0, 0.05), (2, pytest.approx(0.052))]
    assert list(run_curves(_rows(3))) == ["reward_mean"]


def test_curves_table_downsamples_a_long_run_and_marks_missing_values():
    table = curves_table(run_curves(_rows(400, eval_every=100)))
    lines = table.splitlines()
    assert lines[0] == "| step | reward_mean | eval/reward_mean | eval/rev/pass@4 | eval/rev/reward_mean |"
    assert len(lines) == 2 + MAX_ROWS
    assert lines[2] == "| 0 | - | 0.05 | 0.2 | 0.04 |" and lines[-1].startswith("| 400 | 4 | 0.45 |")


def test_summary_keeps_its_keys_and_adds_the_curves(tmp_path):
    rows = _rows(120, eval_every=40)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fs, root = get_fs(str(tmp_path / "run"))
    s = summarize(fs, root, str(tmp_path / "run"), 12.34)
    assert list(s) == ["output_dir", "steps", "wall_s", "reward_first5", "reward_last5", "mismatch_kl_max",
                       "staleness_histogram"]  # fmt: skip
    assert s["steps"] == 120 and s["reward_first5"] == pytest.approx(0.03) and s["reward_last5"] == pytest.approx(1.18)
    md = to_markdown(s, rows)
    assert "| reward_last5 | 1.18 |" in md
    assert "### reward_mean by step (50 of 120 steps, evenly spaced)" in md
    assert "### held-out evaluation by step\n" in md  # 4 evaluations (versions 0, 40, 80, 120): all shown
    assert "eval/reward_mean      ▁▃▆█  0.05 -> 0.17 (min 0.05, max 0.17; steps 0..120, 4 points)" in md
    assert to_markdown(s) == to_markdown(s, []) and "## Curves" not in to_markdown(s)
    assert curves_markdown([{"step": 0, "eval/samples": 3}]) == ""


def test_progress_view_shows_latest_step_reward_and_evaluation():
    view = progress_view(_rows(30, eval_every=20), max_steps=40)
    assert (view.step, view.percent) == (30, 75.0)
    assert view.markdown.startswith("### step 30 / 40 (75%)")
    assert "| reward_mean | 30 | 0.3 |" in view.markdown and "| eval/reward_mean | 20 | 0.07 |" in view.markdown
    only_eval = progress_view(_rows(0, eval_every=1), max_steps=40)
    assert (only_eval.step, only_eval.percent) == (0, 0.0) and "| eval/reward_mean | 0 | 0.05 |" in only_eval.markdown
    empty = progress_view([], max_steps=40)
    assert empty.percent == 0.0 and "waiting for the first step" in empty.markdown
    assert progress_view(_rows(45), max_steps=40).percent == 100.0  # a resume that lowered max_steps


def _wait(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_watcher_follows_the_file_and_survives_bad_reads_and_failed_publishes(tmp_path, caplog):
    fs, root = get_fs(str(tmp_path / "run"))
    seen: list[int] = []
    fail = {"publish": False, "read": False}
    follower = MetricsFollower(fs, root)

    def read() -> list[dict] | None:
        if fail["read"]:
            raise OSError("storage unreachable")
        return follower.poll()

    def publish(rows: list[dict]) -> None:
        if fail["publish"]:
            raise ConnectionError("API down")
        seen.append(progress_view(rows, 10).step)

    log = MetricsLog(fs, root)
    logger = logging.getLogger("test-progress")
    with caplog.at_level(logging.WARNING, "test-progress"):
        with MetricsWatcher(read, publish, logger, interval_s=0.02) as w:
            _wait(lambda: seen == [0])  # no file yet: no rows
            log.record({"step": 1, "reward_mean": 0.5})
            _wait(lambda: seen == [0, 1])
            polls = w.polls
            _wait(lambda: w.polls >= polls + 3)
            assert seen == [0, 1]  # unchanged file: nothing published again
            fail["read"] = True
            _wait(lambda: w.polls >= polls + 8)
            fail["read"], fail["publish"] = False, True
            log.record({"step": 2, "reward_mean": 0.6})
            _wait(lambda: w.polls >= polls + 12)
            fail["publish"] = False
            _wait(lambda: seen == [0, 1, 2])  # the rows whose publish failed are published on a later poll
            (tmp_path / "run" / "metrics.jsonl").write_text("{not json\n")  # clobbered: read again, the line skipped
            _wait(lambda: seen == [0, 1, 2, 0])
            log.record({"step": 3, "reward_mean": 0.7})  # appended after the bad line
        assert seen[-1] == 3  # the last poll when the block exits
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("storage unreachable" in m for m in warnings) == 1  # once per distinct error in a row
    assert sum("ConnectionError: API down" in m for m in warnings) == 1
    assert follower.skipped == 1


def test_the_follower_reads_only_what_was_appended_and_rereads_a_rewritten_file(tmp_path, monkeypatch):
    fs, root = get_fs(str(tmp_path / "run"))
    log, follower = MetricsLog(fs, root), MetricsFollower(fs, root)
    for step in range(1, 6):
        log.record({"step": step, "reward_mean": step / 10, "loss": 1.0})
    assert [r["step"] for r in follower.poll() or []] == [1, 2, 3, 4, 5]
    reads: list[int | None] = []
    cat = fs.cat_file
    monkeypatch.setattr(fs, "cat_file", lambda path, start=None, end=None: reads.append(start) or cat(path, start, end))
    log.record({"step": 6, "reward_mean": 0.6, "loss": 1.0})
    rows = follower.poll() or []
    assert rows[-1] == {"step": 6, "reward_mean": 0.6} and reads[-1] and reads[-1] > 0  # from near the end only
    log.truncate_after(3)  # a rollback rewrites the file shorter
    log.record({"step": 4, "reward_mean": 0.9, "loss": 1.0})
    assert [(r["step"], r["reward_mean"]) for r in follower.poll() or []] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.9)]
    with (tmp_path / "run" / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 5, "rew')  # an append cut short: not a row yet
    assert [r["step"] for r in follower.poll() or []] == [1, 2, 3, 4]
