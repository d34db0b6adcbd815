"""The `toyalgos` algorithm package for the tests (tests/plugins/pkg/toyalgos): the dist-info that registers its
entry points, as `pip install toyalgos` would leave it. Entries are given per entry-point group, so other
extension points of the same package (e.g. `rollflow.losses`) can be registered beside the estimators."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from config.advantage import AdvantageConfig
from config.registry import ADVANTAGE_GROUP, LOSS_GROUP
from engines.orchestrator.estimators import load
from storage import rollouts
from storage.fs import get_fs

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tests" / "plugins" / "pkg"
ENTRIES: dict[str, list[str]] = {
    ADVANTAGE_GROUP: ["rank = toyalgos:RANK", "short = toyalgos:SHORT"],
    LOSS_GROUP: ["sign = toyalgos.losses:SIGN"],
}


def write_site(d: Path, entries: dict[str, list[str]] | None = None) -> Path:
    """`d` holding `toyalgos-0.1.dist-info` with `entries` ({group: ["name = module:attribute", ...]}; default
    ENTRIES) as its entry_points.txt."""
    info = d / "toyalgos-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyalgos\nVersion: 0.1\n")
    groups = ENTRIES if entries is None else entries
    text = "".join(f"[{group}]\n" + "".join(f"{line}\n" for line in lines) + "\n" for group, lines in groups.items())
    (info / "entry_points.txt").write_text(text)
    return d


def on_path(site: Path, monkeypatch) -> Iterator[None]:
    """The package and its dist-info importable in this process (a fixture's body); forgotten afterwards."""
    monkeypatch.syspath_prepend(str(PKG))
    monkeypatch.syspath_prepend(str(site))
    yield
    for name in [m for m in sys.modules if m == "toyalgos" or m.startswith("toyalgos.")]:
        del sys.modules[name]


def dry_run(tmp_path: Path, site: Path | None, *overrides: str) -> subprocess.CompletedProcess:
    """`rollflow rl @ profiles/tiny-cpu.toml ... --dry-run` in a fresh process (as each run component is), the
    package reachable through PYTHONPATH (and its entry points with `site`)."""
    paths = [str(ROOT), str(PKG), *([str(site)] if site else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [sys.executable, "-m", "rollflow.cli", "rl", "@", str(ROOT / "profiles" / "tiny-cpu.toml")]
    cmd += ["--output-dir", str(tmp_path / "run"), *overrides, "--dry-run"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _shaped(names: list[str] | None, values: list[float] | None, reward: float) -> tuple[float, float | None]:
    metrics = dict(zip(names or [], values or [], strict=True))
    penalty = metrics.get("overlong_penalty")
    return reward + (penalty or 0.0), penalty


def check_steps(out: Path, advantage: AdvantageConfig, steps: int) -> list[float | None]:
    """Each step's advantages are the estimator's on its shaped rewards; returns every row's penalty (if shaped)."""
    estimator, (fs, root) = load(advantage), get_fs(str(out))
    penalties: list[float | None] = []
    for step in range(1, steps + 1):
        table, manifest = rollouts.read_step(fs, root, step)
        assert manifest["dropped"] == 0  # every group whole, so the estimator can be re-applied to the shard
        groups: dict[str, list[tuple[float, float]]] = {}
        cols = [
            table.column(c).to_pylist() for c in ("group_id", "reward", "advantage", "metric_names", "metric_values")
        ]
        for group, reward, adv, names, values in zip(*cols, strict=True):
            shaped, penalty = _shaped(names, values, reward)
            penalties.append(penalty)
            groups.setdefault(group, []).append((shaped, adv))
        expected = estimator([[s for s, _ in rows] for rows in groups.values()])
        for rows, want in zip(groups.values(), expected, strict=True):
            assert [a for _, a in rows] == pytest.approx(want, rel=1e-5, abs=1e-5)  # the column is float32
        zero = sum(all(a == 0.0 for _, a in rows) for rows in groups.values())
        assert manifest["zero_advantage_groups"] == zero
    return penalties
