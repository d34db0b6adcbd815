"""Reports over a run's rollout lake (local folder or s3://): what `rollflow lake` prints, exports and plots,
and the filtered selection (`selected`) that `--export` writes and `rollflow sft` trains on from the lake.

Only committed steps are read (through their manifests) and every shard is checked against its
checksum; a corrupted shard or manifest is reported with its path, never skipped silently. Heavy
imports (pyarrow, matplotlib) happen only when a report is made.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

EXIT_CORRUPT = 1
EXIT_USAGE = 2


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class _Acc:
    """Running sums for one group of samples (a step or a policy version)."""

    def __init__(self) -> None:
        self.samples = 0
        self.reward = 0.0
        self.length = 0

    def add(self, rewards: list[float], lengths: list[int]) -> None:
        self.samples += len(rewards)
        self.reward += sum(rewards)
        self.length += sum(lengths)

    def row(self) -> dict[str, Any]:
        n = self.samples or 1
        return {"samples": self.samples, "reward_mean": self.reward / n, "completion_len_mean": self.length / n}


def _uncommitted(fs, parent: str, committed: list[int]) -> list[str]:
    """`step=` folders under `parent` that have no manifest (a write in progress, or a crash)."""
    from storage.fs import step_dirs

    done = set(committed)
    return sorted(d.rstrip("/").rsplit("/", 1)[-1] for n, d in step_dirs(fs, parent).items() if n not in done)


def _weights_summary(fs, root: str, errors: list[dict]) -> dict[str, Any]:
    from storage import weights
    from storage.fs import CorruptError, committed_steps, read_manifest

    versions = committed_steps(fs, weights.weights_root(root))
    kinds: Counter[str] = Counter()
    payload = full = 0
    for v in versions:
        directory = weights.version_dir(root, v)
        try:
            m = read_manifest(fs, directory)
        except CorruptError as exc:
            errors.append({"path": f"{directory}/_manifest.json", "error": str(exc)})
            continue
        kinds[m.get("encoding", "full")] += 1
        files = m["files"]
        size = sum(int(e["bytes"]) for e in files.values())
        payload += int(m.get("payload_bytes", size))
        full += int(m.get("full_bytes", size))
    return {
        "versions": versions,
        "encodings": dict(kinds),
        "payload_bytes": payload,
        "full_bytes": full,
        "payload_ratio": payload / full if full else None,
    }


def verify_stored(output_dir: str) -> tuple[int, list[dict]]:
    """Check every committed weight publication (rebuilding deltas against `model_sha256`) and every
    checkpoint file against its manifest -> (files checked, errors by path)."""
    from storage import checkpoints, weights
    from storage.fs import CorruptError, committed_steps, get_fs, join, read_manifest, read_verified

    fs, root = get_fs(output_dir)
    errors: list[dict] = []
    checked = 0
    for v in committed_steps(fs, weights.weights_root(root)):
        directory = weights.version_dir(root, v)
        try:
            weights.load(fs, directory)
            checked += 1
        except (CorruptError, ValueError) as exc:
            errors.append({"path": directory, "error": str(exc)})
    ck_root = checkpoints.checkpoints_root(root)
    for step in committed_steps(fs, ck_root, checkpoints.TRAINER):
        step_path = f"{ck_root}/step={step:06d}"
        for component in fs.ls(step_path, detail=False):
            directory = join(step_path, component.rstrip("/").rsplit("/", 1)[-1])
            try:
                manifest = read_manifest(fs, directory)
                for name in manifest["files"]:
                    read_verified(fs, directory, name, manifest)
                    checked += 1
            except FileNotFoundError:
                continue  # a component folder without a manifest: not committed, not trusted
            except CorruptError as exc:
                errors.append({"path": directory, "error": str(exc)})
    return checked, errors


def _eval_curves(fs, root: str, errors: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The held-out evaluation curves in metrics.jsonl (storage/metrics.py), by key; {} without any."""
    from storage.fs import join
    from storage.metrics import eval_curve_keys, metric_curve, read_metrics

    try:
        rows = read_metrics(fs, root)
    except (ValueError, KeyError, TypeError) as exc:  # not JSON lines, or a row without a step
        errors.append({"path": join(root, "metrics.jsonl"), "error": f"unreadable: {type(exc).__name__}: {exc}"})
        return {}
    return {key: metric_curve(rows, key) for key in eval_curve_keys(rows)}


def inspect(output_dir: str) -> dict[str, Any]:
    """Everything the summary prints, as a JSON-able dict. `errors` lists corrupt files by path."""
    import pyarrow.compute as pc

    from storage import checkpoints, rollouts
    from storage.fs import CorruptError, get_fs
    from storage.lake_images import ImageStats

    fs, root = get_fs(output_dir)
    images = ImageStats()
    steps = rollouts.committed_rollout_steps(fs, root)
    errors: list[dict] = []
    by_step: dict[int, dict] = {}
    by_version: dict[int, _Acc] = defaultdict(_Acc)
    staleness: Counter[int] = Counter()
    schema_versions: set[int] = set()
    total = _Acc()
    for step in steps:
        try:
            table, manifest = rollouts.read_step(fs, root, step)
        except CorruptError as exc:
            errors.append({"path": rollouts.step_path(root, step), "error": str(exc)})
            continue
        schema_versions.add(int(manifest.get("schema_version", 0)))
        images.add(table)
        rewards = table.column("reward").to_pylist()
        lengths = pc.list_value_length(table.column("completion_ids")).to_pylist()
        versions = table.column("policy_version").to_pylist()
        acc = _Acc()
        acc.add(rewards, lengths)
        total.add(rewards, lengths)
        groups: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
        for r, n, v in zip(rewards, lengths, versions, strict=True):
            groups[v][0].append(r)
            groups[v][1].append(n)
            staleness[rollouts.staleness(step, v)] += 1
        for v, (rs, ns) in groups.items():
            by_version[v].add(rs, ns)
        by_step[step] = {
            **acc.row(),
            "policy_versions": sorted(groups),
            "dropped": manifest.get("dropped", 0),
            "gen_s": manifest.get("gen_s"),
        }
    return {
        "output_dir": output_dir,
        "rollout_steps": steps,
        "uncommitted_step_dirs": _uncommitted(fs, rollouts.rollouts_root(root), steps),
        "schema_versions": sorted(schema_versions),
        **total.row(),
        "images": images.report(),
        "by_step": by_step,
        "by_policy_version": {v: by_version[v].row() for v in sorted(by_version)},
        "staleness_histogram": dict(sorted(staleness.items())),
        "weights": _weights_summary(fs, root, errors),
        "checkpoints": checkpoints.checkpoint_steps(fs, root),
        "eval": _eval_curves(fs, root, errors),
        "evals": _evals(fs, root, errors),
        "errors": errors,
    }


def _evals(fs, root: str, errors: list[dict]) -> dict[str, dict | None]:
    """Each evaluation's summary (None: unfinished), its committed shards checked against their manifests."""
    from storage import evals
    from storage.fs import CorruptError, join

    found = evals.list_evals(fs, root)
    for name in found:
        directory = join(evals.evals_root(root), name)
        try:
            evals.read_samples(fs, directory)
        except CorruptError as exc:
            errors.append({"path": directory, "error": str(exc)})
    return found


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def render(report: dict[str, Any]) -> str:
    steps = report["rollout_steps"]
    span = f" ({steps[0]}..{steps[-1]})" if steps else ""
    lines = [
        f"run {report['output_dir']}",
        f"rollout steps committed: {len(steps)}{span}; samples: {report['samples']}; "
        f"schema version(s): {', '.join(map(str, report['schema_versions'])) or '-'}",
    ]
    if report["uncommitted_step_dirs"]:
        lines.append("uncommitted step folders (no manifest; ignored): " + ", ".join(report["uncommitted_step_dirs"]))
    if steps:
        lines += ["", "by step:"]
        rows = [
            [s, r["samples"], r["reward_mean"], r["completion_len_mean"], r["policy_versions"], r["dropped"]]
            for s, r in report["by_step"].items()
        ]
        lines.append(_table(["step", "samples", "reward", "length", "policy versions", "dropped"], rows))
        lines += ["", "by policy version:"]
        rows = [
            [v, r["samples"], r["reward_mean"], r["completion_len_mean"]]
            for v, r in report["by_policy_version"].items()
        ]
        lines.append(_table(["version", "samples", "reward", "length"], rows))
        lines += ["", "staleness (consuming step - 1 - policy_version) -> samples:"]
        lines.append(_table(["staleness", "samples"], [[k, n] for k, n in report["staleness_histogram"].items()]))
    if report.get("images", {}).get("images"):
        from storage.lake_images import render_stats

        lines += ["", render_stats(report["images"])]
    w = report["weights"]
    ratio = f", payload ratio {w['payload_ratio']:.3f} of full" if w["payload_ratio"] is not None else ""
    enc = ", ".join(f"{k} {n}" for k, n in sorted(w["encodings"].items()))
    lines += ["", f"weight publications: {len(w['versions'])} ({enc or 'none'}){ratio}"]
    lines.append(f"checkpoints: {report['checkpoints'] or 'none'}")
    if report["eval"]:
        lines += ["", "held-out evaluation (metrics.jsonl) by step:", _eval_table(report["eval"])]
    for name, summary in report.get("evals", {}).items():
        lines += ["", render_eval(name, summary)]
    if "verified_files" in report:
        lines.append(f"verified weight and checkpoint files: {report['verified_files']}")
    if report["errors"]:
        lines += ["", f"ERRORS ({len(report['errors'])}): corrupted or unreadable committed data"]
        lines += [f"  {e['path']}: {e['error']}" for e in report["errors"]]
    return "\n".join(lines)


def _eval_table(curves: dict[str, list]) -> str:
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for key, curve in curves.items():
        for step, v in curve:
            by_step[step][key] = v
    return _table(["step", *curves], [[s, *(by_step[s].get(k) for k in curves)] for s in sorted(by_step)])


def render_eval(name: str, summary: dict | None) -> str:
    """One evaluation's summary as a text table (unfinished: a line saying so)."""
    from storage.evals import table_rows

    if summary is None:
        return f"eval {name}: unfinished (no summary; rerun the same command to continue it)"
    header, rows = table_rows(summary)
    return f"eval {name} (policy versions {summary['policy_versions']}):\n" + _table(header, rows)


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """`5` -> (5, 5); `3:7` -> (3, 7) inclusive; `:7` and `3:` are open-ended."""
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            return int(lo), int(lo)
        return (int(lo) if lo else None), (int(hi) if hi else None)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected N, A:B, A: or :B with integers") from None


def selected(
    output_dir: str,
    steps: tuple[int | None, int | None] = (None, None),
    env: str | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    limit: int | None = None,
    storage: Any = None,
) -> Iterator[tuple[int, Any]]:
    """The committed samples that pass the filters, read in place and checksum-verified, as (step, Arrow
    table) in step order, `limit` rows at most in all; `storage`: StorageConfig for `output_dir` (default
    settings if None). A corrupted shard in the selection raises `CorruptError` naming it."""
    import pyarrow.compute as pc

    from storage import rollouts
    from storage.fs import DEFAULT_SETTINGS, get_fs

    fs, root = get_fs(output_dir, storage or DEFAULT_SETTINGS)
    lo, hi = steps
    left = limit
    for step in rollouts.committed_rollout_steps(fs, root):
        if (lo is not None and step < lo) or (hi is not None and step > hi):
            continue
        table, _ = rollouts.read_step(fs, root, step)
        mask = None
        for cond in (
            pc.equal(table.column("env"), env) if env is not None else None,
            pc.greater_equal(table.column("reward"), min_reward) if min_reward is not None else None,
            pc.less_equal(table.column("reward"), max_reward) if max_reward is not None else None,
        ):
            if cond is not None:
                mask = cond if mask is None else pc.and_(mask, cond)
        if mask is not None:
            table = table.filter(mask)
        if left is not None:
            table = table.slice(0, left)
            left -= table.num_rows
        if table.num_rows:
            yield step, table
        if left == 0:
            return


def export(
    output_dir: str,
    path: str,
    steps: tuple[int | None, int | None] = (None, None),
    env: str | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    limit: int | None = None,
) -> int:
    """Write the selected committed samples as JSONL to `path` (local path or URL); returns the count.
    A corrupted shard in the selection raises `CorruptError` naming it."""
    from storage.fs import get_fs, write_bytes_atomic
    from storage.lake_images import jsonable

    lines = [
        json.dumps(jsonable(row))
        for _, table in selected(output_dir, steps, env, min_reward, max_reward, limit)
        for row in table.to_pylist()
    ]
    out_fs, out_path = get_fs(path)
    write_bytes_atomic(out_fs, out_path, "".join(line + "\n" for line in lines).encode())
    return len(lines)


def plot(report: dict[str, Any], out_dir: str) -> list[str]:
    """reward_by_step.png (mean reward per step, per policy version, and the held-out eval/reward_mean when
    metrics.jsonl has it), staleness.png, and eval_by_step.png when metrics.jsonl has evaluation curves."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = list(report["by_step"])
    ax.plot(steps, [report["by_step"][s]["reward_mean"] for s in steps], marker=".", label="by consuming step")
    versions = list(report["by_policy_version"])
    ax.plot(
        [v + 1 for v in versions],
        [report["by_policy_version"][v]["reward_mean"] for v in versions],
        linestyle="--",
        label="by policy version (plotted at version + 1)",
    )
    held_out = report.get("eval", {}).get("eval/reward_mean")
    if held_out:  # version N is the policy after trainer step N, so at x = N (its training samples show at N + 1)
        ax.plot(*zip(*held_out, strict=True), marker="o", label="held-out eval/reward_mean (by policy version)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"reward: {report['output_dir']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "reward_by_step.png"
    fig.savefig(path)
    plt.close(fig)
    written.append(str(path))
    fig, ax = plt.subplots(figsize=(5, 4), dpi=100)
    hist = report["staleness_histogram"]
    ax.bar([str(k) for k in hist], list(hist.values()))
    ax.set_xlabel("staleness (policy steps behind)")
    ax.set_ylabel("samples")
    ax.set_title("staleness histogram")
    fig.tight_layout()
    path = out / "staleness.png"
    fig.savefig(path)
    plt.close(fig)
    written.append(str(path))
    if report.get("eval"):
        written.append(_plot_eval(plt, report, out / "eval_by_step.png"))
    if report.get("images", {}).get("images"):
        sheet = contact_sheet_of(report, str(out / "samples.png"))
        written += [sheet] if sheet else []
    return written


SHEET_STEPS = 4  # steps a contact sheet shows, spread over the run
SHEET_PER_STEP = 4  # samples with images shown per step


def contact_sheet_of(report: dict[str, Any], path: str) -> str | None:
    """samples.png: the first samples with images of a few steps spread over the run (first and last included),
    with their rewards and completions; None when those steps hold no image sample."""
    from storage.lake_images import contact_sheet, with_images

    steps = report["rollout_steps"]
    picked = sorted({steps[round(i * (len(steps) - 1) / max(1, SHEET_STEPS - 1))] for i in range(SHEET_STEPS)})
    samples = []
    for step in picked:
        for _, table in selected(report["output_dir"], (step, step)):
            samples += with_images(table, SHEET_PER_STEP)
    sheet = contact_sheet(samples, columns=SHEET_PER_STEP)
    if sheet is None:
        return None
    sheet.save(path)
    return path


def _plot_eval(plt, report: dict[str, Any], path) -> str:
    """Every held-out evaluation curve of metrics.jsonl (rewards and pass@k share the 0..1 axis)."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for key, curve in report["eval"].items():
        ax.plot(*zip(*curve, strict=True), marker=".", label=key)
    ax.set_xlabel("policy version (trainer step)")
    ax.set_ylabel("score")
    ax.set_title(f"held-out evaluation: {report['output_dir']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
