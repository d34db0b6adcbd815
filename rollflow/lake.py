"""`rollflow lake OUTPUT_DIR`: inspect a run's rollout lake (local folder or s3://).

    rollflow lake OUTPUT_DIR                       summary: steps, samples, reward/length by step and by
                                                   policy version, staleness histogram, weights, checkpoints
    rollflow lake OUTPUT_DIR --json                the same as one JSON document
    rollflow lake OUTPUT_DIR --export out.jsonl [--steps 3:5] [--env reverse-text] [--min-reward 0.5]
                             [--max-reward 1] [--limit 100]      selected samples, one JSON object a line
    rollflow lake OUTPUT_DIR --plot DIR            reward_by_step.png and staleness.png (+ eval_by_step.png
                                                   when metrics.jsonl has held-out evaluation rows; + samples.png,
                                                   a contact sheet of samples with their images, rewards and
                                                   completions, when samples carry images)
    rollflow lake OUTPUT_DIR --verify              also check every weight publication and checkpoint

Only committed steps are read (through their manifests) and every shard is checked against its
checksum. A corrupted shard or manifest is reported with its path and the command exits 1; it is never
skipped silently. Heavy imports (pyarrow, matplotlib) happen only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from storage.lake import EXIT_CORRUPT, EXIT_USAGE, export, inspect, parse_steps, plot, render, verify_stored


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollflow lake", description="Inspect a run's rollout lake.")
    p.add_argument("output_dir", help="the run's OUTPUT_DIR (local path or s3://bucket/prefix)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--export", metavar="FILE", help="write selected samples as JSONL")
    p.add_argument("--steps", help="with --export: N, A:B (inclusive), A: or :B")
    p.add_argument("--env", help="with --export: only this environment")
    p.add_argument("--min-reward", type=float, help="with --export: reward >= X")
    p.add_argument("--max-reward", type=float, help="with --export: reward <= X")
    p.add_argument("--limit", type=int, help="with --export: at most N samples")
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="write reward_by_step.png, staleness.png (eval_by_step.png too with eval rows; samples.png, a contact "
        "sheet, with image samples) into DIR",
    )
    p.add_argument("--verify", action="store_true", help="also check every weight publication and checkpoint file")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from storage.fs import CorruptError, get_fs

    fs, root = get_fs(args.output_dir)
    if not any(fs.exists(f"{root}/{d}") for d in ("rollouts", "weights", "evals")):
        what = "holds no rollouts/, weights/ or evals/; not a rollflow run"
        print(f"rollflow lake: {args.output_dir} {what}", file=sys.stderr)
        return EXIT_USAGE
    if args.export:
        try:
            steps = parse_steps(args.steps) if args.steps else (None, None)
            n = export(args.output_dir, args.export, steps, args.env, args.min_reward, args.max_reward, args.limit)
        except CorruptError as exc:
            print(f"rollflow lake: {exc}", file=sys.stderr)
            return EXIT_CORRUPT
        except ValueError as exc:
            print(f"rollflow lake: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"exported {n} samples to {args.export}", file=sys.stderr)
    report = inspect(args.output_dir)
    if args.verify:
        checked, errors = verify_stored(args.output_dir)
        report["verified_files"] = checked
        report["errors"] += errors
    print(json.dumps(report, indent=1) if args.json else render(report))
    if args.plot:
        for path in plot(report, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return EXIT_CORRUPT if report["errors"] else 0
