"""The soak's audit (tests/soak/audit.py) on a run directory written with the project's own commit functions: a
sound run passes; each kind of damage the soak must catch (a flipped byte, a step trained twice, a duplicated
sample id, a stale sample, an unfinished run) is one finding."""

from __future__ import annotations

import json
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from storage import rollouts
from storage.fs import commit_dir
from tests.soak.audit import audit_run
from tests.unit.test_rollouts import _rows

STEPS = 3


def _run(out: Path) -> Path:
    fs = LocalFileSystem()
    for step in range(1, STEPS + 1):
        rollouts.write_step(fs, str(out), step, rollouts.to_table(_rows(step)), {})
    for v in range(STEPS + 1):
        commit_dir(fs, str(out / "weights" / f"step={v:06d}"), {"model.safetensors": b"w%d" % v * 50}, {})
    commit_dir(fs, str(out / "checkpoints" / f"step={STEPS:06d}" / "trainer"), {"model.safetensors": b"c" * 80}, {})
    rows = [json.dumps({"step": s, "time": 1.0 + s}) for s in range(1, STEPS + 1)]
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (out / "state.json").write_text(json.dumps({"status": "finished"}))
    return out


def test_a_sound_run_passes(tmp_path):
    assert audit_run(_run(tmp_path), STEPS, {}) == []


def test_a_flipped_byte_in_a_checkpoint_is_found(tmp_path):
    out = _run(tmp_path)
    victim = out / "checkpoints" / f"step={STEPS:06d}" / "trainer" / "model.safetensors"
    victim.write_bytes(b"d" + victim.read_bytes()[1:])
    problems = audit_run(out, STEPS, {})
    assert len(problems) == 1 and "checksum mismatch" in problems[0] and str(victim) in problems[0]


def test_a_step_trained_twice_and_an_unfinished_run_are_found(tmp_path):
    out = _run(tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": STEPS, "time": 9.0}) + "\n")
    (out / "state.json").write_text(json.dumps({"status": "running"}))
    problems = audit_run(out, STEPS, {})
    assert len(problems) == 2 and f"repeated [{STEPS}]" in problems[0] and "running" in problems[1], problems


def test_duplicated_and_stale_samples_and_a_rewritten_step_are_found(tmp_path):
    out = _run(tmp_path)
    snapshot = {1: (out / "rollouts" / "step=000001" / "_manifest.json").read_text()}
    rows = _rows(2)  # step 4 carries step 2's sample ids, sampled by policy 0: staleness 3
    rows = [{**r, "step": 4, "policy_version": 0} for r in rows]
    rollouts.write_step(LocalFileSystem(), str(out), 4, rollouts.to_table(rows), {})
    rollouts.write_step(LocalFileSystem(), str(out), 1, rollouts.to_table(_rows(1, n=2)), {})
    problems = audit_run(out, STEPS, snapshot)
    assert any("duplicated sample ids" in p for p in problems), problems
    assert any("staleness outside 0..2: [3]" in p for p in problems), problems
    assert any("rollout step 1 was committed twice" in p for p in problems), problems


def test_the_report_rewrites_its_tables_and_keeps_the_hand_written_part(tmp_path):
    from tests.soak.record import FaultRecord, SegmentResult
    from tests.soak.report import KEPT_MARKER, write_report

    doc = tmp_path / "reliability.md"
    doc.write_text(f"# old tables\n\n{KEPT_MARKER}\n\n## What is not covered\n\nkept words\n")
    faults = [FaultRecord("sigkill:trainer", 10.0, 12.5, 1), FaultRecord("sigkill:trainer", 50.0, 7.5, 0)]
    result = SegmentResult("dense-local", "tiny", 40, 100.0, faults=faults)
    write_report([result], "make soak", 1, 600.0, doc)
    text = doc.read_text()
    assert "old tables" not in text and text.endswith("kept words\n") and text.count(KEPT_MARKER) == 1
    assert "| sigkill:trainer | 2 | 2 | 10.0 | 12.5 | 1, 1 |" in text
