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


def _side(name: str, step_s: float, pss: float, repeat: int) -> peer_trl.Side:
    m = peer_trl.Measured(start=0.0, end=100.0 + repeat, peak_pss_mb=pss, samples=10, sampler_cpu_s=1.0)
    ends = [5.0 + step_s * i for i in range(10)]
    notes = {"settings": {"max_steps": 10}, "defaults": {"beta": 0.0}, "model": "LlamaForCausalLM"}
    return peer_trl.Side(name, m, ends, [0.1 * i for i in range(10)], notes)


def test_the_section_shows_every_side_and_the_ratios_repeat_by_repeat():
    sides = {
        name: [_side(name, step, pss, i) for i in range(2)]
        for name, step, pss in (("rollflow", 0.5, 1500.0), ("TRL default", 1.0, 600.0), ("TRL 1 thread", 2.0, 600.0))
    }
    text = peer_trl.render(sides, {"prompts": 32, "max_logit_diff": 0.0}, 10, [1.0, 1.5, 2.0])
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert [r.split(" | ")[0] for r in rows] == ["| rollflow", "| TRL default", "| TRL 1 thread"]
    assert "2.00x (2.00-2.00) as fast per RL step" in text and "2.50x (2.50-2.50) its peak memory" in text
    assert rows[0].endswith(" | 0.200 → 0.700 |") and "0.500 (0.500-0.500)" in rows[0]
    assert "2 run(s) per side" in text and "load average 1.00 / 1.50 / 2.00" in text
