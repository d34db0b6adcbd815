"""Storage benchmark: `python -m tests.bench.storage [--repeats 5] [--backends local,s3] [--step-s 0.93]`.

Prints markdown tables (min / median / max over repeats):

1. Shard write and read throughput of rollflow's commit protocol (`storage.rollouts.write_step`:
   IPC serialization, sha256, atomic write, manifest; `read_step`: manifest, read, checksum, parse) as a
   ratio to raw pyarrow IPC writes/reads of the same table through pyarrow's own filesystem
   (`pyarrow.fs.LocalFileSystem` / `S3FileSystem`) on the same storage. Target >= 0.8. The "vs
   raw+sha256" columns add the time to sha256 the shard to the raw side: the part of the gap that is
   the checksum itself rather than the protocol.
2. Per-step storage overhead of the tiny profile (one step's shard commit, the trainer's commit check
   and verified read, a weight publication, the orchestrator's version listing and the engine's load),
   as a fraction of the step time `--step-s` (default 0.93 s: tiny-cpu, async_level 1, from
   docs/benchmarks.md; or `--metrics OUTPUT_DIR/metrics.jsonl` for a run's median `step_s`). Target <= 2%.
3. Delta publication payload ratio for the tiny profile's model: successive AdamW steps (the profile's
   lr) on the environments' data, published with `storage.weights_delta`; payload bytes / full bytes.

Backends: "local" (a temporary folder; `BENCH_TMP` picks where), "local-nofsync" (the same with
`storage.fsync = false`, which is what raw pyarrow does), and "s3", a moto S3 server on 127.0.0.1
(tests/s3util.py): it measures the protocol's request overhead
against an in-process Python server, not a real object store's bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from config.storage import StorageConfig
from storage import fs as sfs
from storage import rollouts, weights
from tests.bench import harness

TITLE = "Storage (tests/bench/storage.py)"


def synthetic_table(rows: int, seed: int = 0) -> pa.Table:
    """Rollout rows shaped like the tiny profile's (prompts ~12 tokens, completions up to 12)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(rows):
        n = rng.randint(3, 12)
        out.append(
            {
                "run_id": "bench-run",
                "step": 1,
                "sample_id": f"s000001-g{i // 8:04d}-{i % 8:02d}",
                "group_id": f"s000001-g{i // 8:04d}",
                "env": rng.choice(["reverse-text", "sort-letters"]),
                "policy_version": 0,
                "policy_version_end": 0,
                "prompt_ids": [1] + [rng.randint(4, 40) for _ in range(rng.randint(8, 14))],
                "completion_ids": [rng.randint(4, 40) for _ in range(n)],
                "completion_logprobs": [-rng.random() for _ in range(n)],
                "reward": rng.random(),
                "advantage": rng.gauss(0, 1),
                "temperature": 1.0,
                "finish_reason": "stop",
                "prompt_text": "rev:abcdefg=",
                "completion_text": "gfedcba"[: rng.randint(1, 7)],
            }
        )
    return rollouts.to_table(out)


def stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def fmt3(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    lo, mid, hi = stats([v * scale for v in values])
    return f"{mid:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def timed(fn: Callable[..., object], *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def raw_write(pa_fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    with pa_fs.open_output_stream(path) as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)


def raw_read(pa_fs: pafs.FileSystem, path: str) -> pa.Table:
    with pa_fs.open_input_file(path) as src:
        return pa.ipc.open_file(src).read_all()


def check_and_read(fs, root: str, step: int) -> None:
    sfs.is_committed(fs, rollouts.step_path(root, step))
    rollouts.read_step(fs, root, step)


def list_and_load(fs, root: str) -> None:
    weights.load(fs, weights.version_dir(root, weights.latest_version(fs, root) or 0))


@contextlib.contextmanager
def backend(name: str) -> Iterator[tuple[str, StorageConfig, pafs.FileSystem, str]]:
    """(rollflow URL root, its storage settings, pyarrow filesystem, pyarrow path root) for one backend."""
    if name.startswith("local"):
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            yield tmp, StorageConfig(fsync=name != "local-nofsync"), pafs.LocalFileSystem(), tmp
        return
    from tests.s3util import BUCKET, CREDENTIALS, moto_s3

    os.environ.update(CREDENTIALS)
    with moto_s3() as endpoint:
        s3 = pafs.S3FileSystem(endpoint_override=endpoint, region="us-east-1")
        yield f"s3://{BUCKET}/bench", StorageConfig(endpoint_url=endpoint), s3, f"{BUCKET}/bench"


def throughput(name: str, tables: dict[str, pa.Table], repeats: int) -> list[str]:
    rows = []
    with backend(name) as (url, settings, pa_fs, pa_root):
        fs, root = sfs.get_fs(url, settings)
        for label, table in tables.items():
            w_rf, w_raw, r_rf, r_raw, sha = [], [], [], [], []
            ipc = rollouts._ipc_bytes(table)
            mb = None
            for i in range(repeats):
                step = i + 1
                raw_path = f"{pa_root}/raw-{label}/part-{i:05d}.arrow"
                if name.startswith("local"):
                    pa_fs.create_dir(f"{pa_root}/raw-{label}", recursive=True)
                ours = root + f"/{label}"
                # alternate the order so neither side always runs on a warmer cache
                if i % 2:
                    w_raw.append(timed(raw_write, pa_fs, raw_path, table))
                    w_rf.append(timed(rollouts.write_step, fs, ours, step, table, {}))
                    r_raw.append(timed(raw_read, pa_fs, raw_path))
                    r_rf.append(timed(rollouts.read_step, fs, ours, step))
                else:
                    w_rf.append(timed(rollouts.write_step, fs, ours, step, table, {}))
                    w_raw.append(timed(raw_write, pa_fs, raw_path, table))
                    r_rf.append(timed(rollouts.read_step, fs, ours, step))
                    r_raw.append(timed(raw_read, pa_fs, raw_path))
                sha.append(timed(sfs.sha256, ipc))  # what any checksummed write or verified read must pay
                mb = pa_fs.get_file_info(raw_path).size / 1e6
            assert mb is not None
            w_ratio = [raw / rf for raw, rf in zip(w_raw, w_rf, strict=True)]
            r_ratio = [raw / rf for raw, rf in zip(r_raw, r_rf, strict=True)]
            w_floor = [(raw + h) / rf for raw, h, rf in zip(w_raw, sha, w_rf, strict=True)]
            r_floor = [(raw + h) / rf for raw, h, rf in zip(r_raw, sha, r_rf, strict=True)]
            rows.append(
                f"| {name} | {label} ({table.num_rows} rows, {mb:.2f} MB) "
                f"| {fmt3([mb / t for t in w_rf], digits=0)} | {fmt3([mb / t for t in w_raw], digits=0)} "
                f"| **{fmt3(w_ratio)}** | {fmt3(w_floor)} | {fmt3([mb / t for t in r_rf], digits=0)} "
                f"| {fmt3([mb / t for t in r_raw], digits=0)} | **{fmt3(r_ratio)}** | {fmt3(r_floor)} |"
            )
    return rows


def tiny_model():
    from config.loader import load_run_config
    from engines.models.decoder import CausalLM
    from engines.models.tokenizer import CharTokenizer

    cfg = load_run_config(["profiles/tiny-cpu.toml"])
    return cfg, CausalLM(cfg.model, CharTokenizer().vocab_size)


def step_overhead(name: str, repeats: int, step_s: float) -> list[str]:
    """One tiny-profile step's storage work, timed per operation."""
    import torch

    torch.set_num_threads(1)
    cfg, model = tiny_model()
    table = synthetic_table(cfg.orchestrator.batch_size * cfg.orchestrator.group_size)
    out = []
    for delta in (False, True):
        per_step: list[float] = []
        parts: dict[str, list[float]] = {"commit shard": [], "check+read shard": [], "publish": [], "list+load": []}
        with backend(name) as (url, settings, _, _):
            s = settings.model_copy(update={"weights_delta": delta})
            fs, root = sfs.get_fs(url + f"/overhead-{int(delta)}", s)
            publisher = weights.Publisher(fs, root)
            publisher.publish(0, model.publishable_state_dict())
            for step in range(1, repeats + 1):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 1e-3)
                t = [
                    timed(rollouts.write_step, fs, root, step, table, {"gen_s": 0.1}),
                    timed(check_and_read, fs, root, step),
                    timed(publisher.publish, step, model.publishable_state_dict()),
                    timed(list_and_load, fs, root),
                ]
                for key, v in zip(parts, t, strict=True):
                    parts[key].append(v)
                per_step.append(sum(t))
        detail = ", ".join(f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in parts.items())
        # the trainer waits for its own storage work only: checking/reading the shard and publishing
        trainer = [a + b for a, b in zip(parts["check+read shard"], parts["publish"], strict=True)]
        out.append(
            f"| {name} | {'delta' if delta else 'full'} | {fmt3(per_step, 1e3, 1)} | {detail} "
            f"| **{fmt3([v / step_s for v in per_step], 100, 2)}** | {fmt3([v / step_s for v in trainer], 100, 2)} |"
        )
    return out


def delta_ratio(steps: int) -> list[str]:
    """Payload ratio of delta publications over successive AdamW steps on the tiny profile."""
    import torch

    from engines.environments.base import EnvMix
    from engines.models.tokenizer import CharTokenizer
    from engines.trainer.sft import sft_batch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg, model = tiny_model()
    tok = CharTokenizer()
    mix = EnvMix(cfg.envs, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.optim.lr, betas=cfg.trainer.optim.betas)
    ratios, fulls, payloads = [], 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        fs, root = sfs.get_fs(tmp, StorageConfig(weights_delta=True, weights_full_every=10**9))
        publisher = weights.Publisher(fs, root)
        publisher.publish(0, model.publishable_state_dict())
        for v in range(1, steps + 1):
            ids, mask = sft_batch(mix, tok, v, cfg.orchestrator.batch_size)
            logits = model(ids)[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            opt.zero_grad()
            ((nll * mask).sum() / mask.sum()).backward()
            opt.step()
            publisher.publish(v, model.publishable_state_dict())
            m = sfs.read_manifest(fs, weights.version_dir(root, v))
            assert m["encoding"] == "delta"
            rebuilt = weights.load(fs, weights.version_dir(root, v))  # exact, or CorruptError
            assert all(torch.equal(rebuilt[k], t) for k, t in model.publishable_state_dict().items())
            ratios.append(m["payload_bytes"] / m["full_bytes"])
            fulls += m["full_bytes"]
            payloads += m["payload_bytes"]
    n = sum(p.numel() for p in model.parameters())
    return [
        f"| tiny-cpu ({n / 1e6:.2f}M params, fp32, AdamW lr {cfg.trainer.optim.lr}) | {steps} "
        f"| {fulls / steps / 1e6:.2f} MB | {payloads / steps / 1e6:.2f} MB | **{fmt3(ratios, 1, 3)}** |"
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.storage", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="local,local-nofsync,s3", help="local (fsync on), local-nofsync, s3 (moto)")
    p.add_argument("--step-s", type=float, default=0.93, help="step time the overhead is a fraction of")
    p.add_argument("--metrics", help="a run's metrics.jsonl: use its median step_s instead of --step-s")
    p.add_argument("--large-rows", type=int, default=65536)
    args = p.parse_args(argv)
    step_s = args.step_s
    run_rows: list[dict] = []
    if args.metrics:
        with open(args.metrics) as f:
            run_rows = [json.loads(line) for line in f if line.strip()]
        step_s = statistics.median(r["step_s"] for r in run_rows)
    backends = [b for b in args.backends.split(",") if b]
    tables = {"tiny step": synthetic_table(256), "large shard": synthetic_table(args.large_rows)}
    print(f"## Shard throughput vs raw pyarrow IPC (MB/s; median (min-max) over {args.repeats} repeats)\n")
    print(
        "| storage | shard | rollflow write | raw write | **write ratio** | write ratio vs raw+sha256 "
        "| rollflow read | raw read | **read ratio** | read ratio vs raw+sha256 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in backends:
        for row in throughput(b, tables, args.repeats):
            print(row, flush=True)
    print(f"\n## Per-step storage overhead, tiny profile (ms; fraction of a {step_s:.3f} s step)\n")
    print(
        "| storage | weights | storage ms / step | median ms per part | **all storage, % of step** "
        "| trainer's critical path, % of step |"
    )
    print("|---|---|---|---|---|---|")
    for b in backends:
        for row in step_overhead(b, args.repeats, step_s):
            print(row, flush=True)
    if run_rows:
        # measured by the trainer itself: publish_s, and wait_s (the verified shard read, plus any waiting)
        pub = [r["publish_s"] / r["step_s"] for r in run_rows]
        both = [(r["publish_s"] + r["wait_s"]) / r["step_s"] for r in run_rows]
        print(
            f"\nIn the run ({args.metrics}, {len(run_rows)} steps): publish_s / step_s = {fmt3(pub, 100)} %, "
            f"(publish_s + wait_s) / step_s = {fmt3(both, 100)} % (median (min-max))."
        )
    print("\n## Delta weight publication payload (vs full publication)\n")
    print("| model | versions | full / version | delta payload / version | **payload ratio** |")
    print("|---|---|---|---|---|")
    for row in delta_ratio(max(args.repeats, 5)):
        print(row, flush=True)


def run(ws: harness.Workspace) -> str:
    """`make bench`'s section: this module's own process (its fsync and S3 figures away from the runner's
    threads), quick mode with one repeat and a small large shard."""
    quick = ["--repeats", "1", "--large-rows", "4096"] if harness.QUICK else []
    return harness.demoted(harness.module_output("tests.bench.storage", *quick))


if __name__ == "__main__":
    main()
