"""tests/bench/peer_trl.py's parts that run without TRL: the process-tree PSS sampler counts children, and the
prompt stream both sides get is rollflow's own, in step and group order. (`make bench-quick` runs the whole
comparison, TRL included.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.bench import peer_trl

CHILD = "import sys, time; x = bytearray(64 << 20); sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(30)"


def test_tree_pss_counts_the_whole_process_tree():
    alone = peer_trl.tree_pss_kib(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        with_child = peer_trl.tree_pss_kib(os.getpid())
        assert with_child - alone > 60 * 1024, (alone, with_child)  # the child's 64 MiB buffer, at least
        assert peer_trl.tree_pss_kib(child.pid) < with_child
    finally:
        child.kill()
        child.wait(timeout=10)


def test_measure_reports_the_peak_and_refuses_a_failing_command(tmp_path: Path):
    m = peer_trl.measure([sys.executable, "-c", CHILD.replace("30", "1")], dict(os.environ), tmp_path / "a.log", 60)
    assert m.peak_pss_mb > 64 and m.samples >= 2 and 0.9 < m.end - m.start < 30
    try:
        peer_trl.measure([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), tmp_path / "b.log", 60)
    except RuntimeError as exc:
        assert "exited 3" in str(exc)
    else:
        raise AssertionError("a failing command was not reported")


def test_prompts_are_rollflows_stream_in_step_and_group_order(tmp_path: Path):
    cfg = peer_trl.run_config(tmp_path)
    keys = peer_trl.prompt_keys(cfg, 3)
    assert len(keys) == 3 * cfg.orchestrator.batch_size and keys[0] == "step=1/group=0"
    assert keys[cfg.orchestrator.batch_size] == "step=2/group=0"
    mix = peer_trl.env_mix(cfg)
    tasks = [mix.task(k) for k in keys]
    assert {t.env for t in tasks} == {"reverse-text"}
    assert all(t.prompt.startswith("rev:") and t.answer == t.prompt[4:][::-1] for t in tasks)
    assert [t.prompt for t in tasks] == [peer_trl.env_mix(cfg).task(k).prompt for k in keys]  # a pure function
    assert mix.reward(tasks[0], tasks[0].answer) == 1.0 and mix.reward(tasks[0], "") == 0.0
