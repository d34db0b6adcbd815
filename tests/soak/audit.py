"""The independent audit of a finished run directory: what the soak and the resume tests check after a run.

It reads only what the run left on disk (rollouts, metrics.jsonl, weights, checkpoints, state.json) and returns
its findings as a list of sentences (empty: the audit passed), so a soak can report them and a test can assert on
them. Checks: every trainer step recorded exactly once and in order; every rollout step committed, never
rewritten after the driver saw it committed (`snapshots`), and holding exactly the files its manifest lists; no
duplicated sample id; the staleness bound held; every committed manifest (rollouts, weights, checkpoints) and
every file it lists verify (storage/fs.py read_manifest / read_verified); the run marked finished.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
from fsspec.implementations.local import LocalFileSystem

from storage.fs import CorruptError, read_manifest, read_verified
from storage.rollouts import staleness


def checkpoints(out: Path) -> list[int]:
    """Steps of the committed trainer checkpoints, ascending."""
    root = out / "checkpoints"
    if not root.exists():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir() if (p / "trainer" / "_manifest.json").exists())


def committed_rollouts(out: Path) -> dict[int, str]:
    """Rollout step -> the text of its manifest, for every committed step."""
    root = out / "rollouts"
    found = {}
    for p in sorted(root.iterdir()) if root.exists() else []:
        try:
            found[int(p.name[5:])] = (p / "_manifest.json").read_text()
        except (FileNotFoundError, ValueError):
            continue
    return found


def trained_steps(out: Path) -> list[int]:
    """The `step` of every row of metrics.jsonl, in file order (a row cut short by a kill is skipped)."""
    steps = []
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def _rollout_problems(out: Path, max_steps: int, snapshots: dict[int, str], max_stale: int) -> list[str]:
    committed = committed_rollouts(out)
    problems = []
    if sorted(committed) != list(range(1, max_steps + 1)):
        missing = sorted(set(range(1, max_steps + 1)) - set(committed))
        problems.append(f"rollout steps committed: {len(committed)}, missing {missing[:10]}")
    for step, manifest in snapshots.items():
        if step in committed and committed[step] != manifest:
            problems.append(f"rollout step {step} was committed twice")
    for step in committed:
        listed = set(json.loads(committed[step])["files"]) | {"_manifest.json"}
        found = {p.name for p in (out / "rollouts" / f"step={step:06d}").iterdir()}
        if found != listed:
            problems.append(f"rollout step {step}: files {sorted(found ^ listed)} not as its manifest lists")
    if not committed:
        return problems
    table = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table()
    ids = table.column("sample_id").to_pylist()
    if len(ids) != len(set(ids)):
        problems.append(f"{len(ids) - len(set(ids))} duplicated sample ids")
    versions = zip(table.column("step").to_pylist(), table.column("policy_version").to_pylist(), strict=True)
    stale = sorted({staleness(s, v) for s, v in versions} - set(range(max_stale + 1)))
    if stale:
        problems.append(f"staleness outside 0..{max_stale}: {stale}")
    return problems


def manifest_problems(out: Path) -> list[str]:
    """Every committed directory under rollouts/, weights/ and checkpoints/ whose manifest or files fail to verify."""
    fs, problems = LocalFileSystem(), []
    for manifest in sorted(out.glob("*/step=*/**/_manifest.json")):
        if manifest.parts[len(out.parts)] not in ("rollouts", "weights", "checkpoints"):
            continue
        directory = str(manifest.parent)
        try:
            listed = read_manifest(fs, directory)
            for name in listed["files"]:
                read_verified(fs, directory, name, listed)
        except (CorruptError, OSError) as exc:
            problems.append(f"corrupt: {exc}")
    return problems


def audit_run(
    out: Path, max_steps: int, snapshots: dict[int, str], max_stale: int = 2, every_weight: bool = True
) -> list[str]:
    """The audit's findings for the run in `out` (see the module docstring); `every_weight`: every policy version
    0..max_steps must still be published (False for runs that prune old publications)."""
    problems = _rollout_problems(out, max_steps, snapshots, max_stale)
    steps = trained_steps(out)
    if steps != list(range(1, max_steps + 1)):
        dup = sorted({s for s in steps if steps.count(s) > 1})
        problems.append(f"trainer steps: {len(steps)} rows for {max_steps} steps (repeated {dup[:10]})")
    versions = range(max_steps + 1) if every_weight else [max_steps]
    absent = [v for v in versions if not (out / "weights" / f"step={v:06d}" / "_manifest.json").exists()]
    if absent:
        problems.append(f"weight publications missing: {absent[:10]}")
    problems += manifest_problems(out)
    try:
        status = json.loads((out / "state.json").read_text())["status"]
    except (OSError, ValueError, KeyError) as exc:
        status = f"unreadable ({exc})"
    if status != "finished":
        problems.append(f"state.json status is {status}, not finished")
    return problems
