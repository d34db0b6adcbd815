"""The resume audit of one run directory: every step exactly once, no lost or duplicated sample id, the staleness
bound held, each committed rollout step unchanged since it was first seen, the run finished.

It returns its findings instead of asserting, so that a soak segment (tests/soak/) can report them;
tests/integration/test_resume.py `_assert_nothing_lost_or_duplicated` asserts that there are none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds

from storage.rollouts import staleness


def committed_rollouts(out: Path) -> dict[int, str]:
    """Rollout step -> its manifest's text, for the steps committed so far."""
    root = out / "rollouts"
    found = {}
    for p in sorted(root.iterdir()) if root.exists() else []:
        try:
            found[int(p.name[5:])] = (p / "_manifest.json").read_text()
        except FileNotFoundError:
            continue
    return found


def _rollout_problems(out: Path, committed: dict[int, str]) -> list[str]:
    problems = []
    for step in committed:
        listed = set(json.loads(committed[step])["files"]) | {"_manifest.json"}
        found = {p.name for p in (out / "rollouts" / f"step={step:06d}").iterdir()}
        if found != listed:
            problems.append(f"rollout step {step} holds {sorted(found)}, its manifest lists {sorted(listed)}")
    table = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table()
    ids = table.column("sample_id").to_pylist()
    if len(ids) != len(set(ids)):
        problems.append(f"{len(ids) - len(set(ids))} duplicate sample_id(s)")
    for step, version in zip(table.column("step").to_pylist(), table.column("policy_version").to_pylist(), strict=True):
        if not 0 <= staleness(step, version) <= 2:
            problems.append(f"rollout step {step} from policy version {version}: staleness out of bounds")
            break
    return problems


def nothing_lost_or_duplicated(out: Path, max_steps: int, snapshots: dict[int, str]) -> list[str]:
    """The audit's findings; empty: it passed. `snapshots`: committed manifests seen during the run."""
    committed = committed_rollouts(out)
    if sorted(committed) != list(range(1, max_steps + 1)):
        return [f"committed rollout steps {sorted(committed)}, expected 1..{max_steps}"]
    problems = [f"rollout step {s} was committed twice" for s, m in snapshots.items() if committed[s] != m]
    problems += _rollout_problems(out, committed)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    if [json.loads(line)["step"] for line in lines] != list(range(1, max_steps + 1)):
        problems.append(f"metrics.jsonl steps {[json.loads(line)['step'] for line in lines]}")
    problems += [f"no weights step={v}" for v in range(max_steps + 1)
                 if not (out / "weights" / f"step={v:06d}" / "_manifest.json").exists()]  # fmt: skip
    status = json.loads((out / "state.json").read_text())["status"]
    if status != "finished":
        problems.append(f"state.json status {status!r}")
    return problems
