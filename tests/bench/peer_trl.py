"""Peer comparison: rollflow's `rollflow rl` against TRL's GRPOTrainer on the same model, prompts, reward and batch.

`python -m tests.bench.peer_trl [--quick]` prints its markdown section; `make bench` includes it (`peer`).

Data flow:
1. One warm-up (tiny-cpu + tests/bench/peer_trl.toml, the reverse-text task alone) publishes policy version 0,
   a Hugging Face directory `weights/step=000000`. Both sides start from that directory.
2. Checked, not assumed, before any timing: the same weights (rollflow's model and transformers'
   `AutoModelForCausalLM` give the same logits on a batch of prompts), the same prompt ids (rollflow's tokenizer
   and the chat template TRL applies), the same decoding of completions.
3. The prompts are rollflow's own stream, `EnvMix.task("step=S/group=G")` with the run's seed, S = 1..steps,
   G = 0..31: TRL gets them as a dataset in that order (shuffle off) and afterwards the rollflow run's lake is read
   to check it drew the same prompts in the same steps; TRL's reward function checks its keys' order.
4. The reward on both sides is the environment's own (`EnvMix.reward`: difflib similarity).
5. Each side is one command in its own process tree: `python -m rollflow.cli rl ...` (Prefect, MLflow and the
   three components, as a user runs it) and `python -m tests.bench.peer_trl --trl-child SPEC` (one process).
   A sampler sums PSS (/proc/PID/smaps_rollup) over the whole tree every 0.2 s and keeps the peak.
   Step times are step ends: rollflow's metrics.jsonl `time`, TRL's `on_step_end` callback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.bench import harness

TITLE = "Peer trainer: rollflow against TRL's GRPOTrainer (tests/bench/peer_trl.py)"
PEER_PROFILE = harness.ROOT / "tests/bench/peer_trl.toml"
PROFILES = [harness.ROOT / "profiles/tiny-cpu.toml", PEER_PROFILE]
FULL_STEPS, QUICK_STEPS = 100, 5
LOGIT_TOLERANCE = 1e-4  # fp32, two implementations of the same Llama: agreement to rounding
SAMPLE_S = 0.2


def steps() -> int:
    return QUICK_STEPS if harness.QUICK else FULL_STEPS


# --- the workload, shared by both sides -------------------------------------------------------------------


def run_config(output_dir: Path, **overrides: object):
    from config.loader import load_run_config

    pairs = [(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in overrides.items()]
    cfg = load_run_config(PROFILES, [("output_dir", str(output_dir)), *pairs])
    if harness.QUICK:
        cfg.sft.steps = min(cfg.sft.steps, 20)
    return cfg


def prompt_keys(cfg, n_steps: int) -> list[str]:
    """The orchestrator's task keys (engines/orchestrator/loop.py), step by step, group by group."""
    return [f"step={s}/group={g}" for s in range(1, n_steps + 1) for g in range(cfg.orchestrator.batch_size)]


def env_mix(cfg):
    from engines.environments.base import EnvMix

    return EnvMix(cfg.envs, cfg.seed, "tag")


# --- checks: the same model, tokens and text on both sides --------------------------------------------------


def check_same_model(publication: Path, prompts: list[str]) -> dict[str, object]:
    """Logits of rollflow's model and transformers' on every prompt, prompt ids and decoding; raises on a difference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from config.model import ModelConfig
    from engines.models import modeldir

    ours = modeldir.load(ModelConfig(path=str(publication)), pretrained=True)
    hf = AutoModelForCausalLM.from_pretrained(str(publication)).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(publication))
    worst = 0.0
    for text in prompts:
        ids = ours.tokenizer.render_prompt(text)
        theirs = hf_tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]  # fmt: skip
        if list(theirs) != ids:
            raise AssertionError(f"prompt ids differ for {text!r}: rollflow {ids}, TRL's chat template {theirs}")
        x = torch.tensor([ids])
        with torch.no_grad():
            diff = (ours.model.eval()(x).float() - hf(input_ids=x).logits.float()).abs().max().item()
        worst = max(worst, diff)
        if hf_tok.decode(ids[1:], skip_special_tokens=True) != ours.tokenizer.decode(ids[1:]):
            raise AssertionError(f"decoding differs for {ids}")
    if worst > LOGIT_TOLERANCE:
        raise AssertionError(f"logits differ by {worst:.3g} > {LOGIT_TOLERANCE} between rollflow and transformers")
    dtypes = {str(p.dtype) for p in hf.parameters()} | {str(p.dtype) for p in ours.model.parameters()}
    if dtypes != {"torch.float32"}:
        raise AssertionError(f"not fp32 on both sides: {dtypes}")
    return {"prompts": len(prompts), "max_logit_diff": worst, "hf_class": type(hf).__name__}


# --- measuring a process tree ------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Direct children of `pid` from /proc/PID/task/TID/children (cheap: no scan of every process)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass  # gone meanwhile
    return out


def tree_pss_kib(root: int) -> int:
    """PSS summed over `root` and all its descendants (processes that vanish meanwhile count 0)."""
    todo, total = [root], 0
    while todo:
        pid = todo.pop()
        todo += _children(pid)
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total


@dataclass
class Measured:
    """One command: wall clock start and end, peak PSS of its tree, and its exit status."""

    start: float = 0.0
    end: float = 0.0
    peak_pss_mb: float = 0.0
    rc: int = 0
    samples: int = 0
    sampler_cpu_s: float = 0.0  # the sampler's own CPU time (it shares the machine with the command)


def measure(argv: list[str], env: dict[str, str], log: Path, limit_s: float) -> Measured:
    """Run argv (output to `log`), sampling its tree's PSS every SAMPLE_S; kill the tree past `limit_s`."""
    m, cpu0 = Measured(), time.process_time()
    with open(log, "w") as out:
        m.start = time.time()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=harness.ROOT,
                                start_new_session=True)  # fmt: skip
        while proc.poll() is None:
            m.peak_pss_mb = max(m.peak_pss_mb, tree_pss_kib(proc.pid) / 1024)
            m.samples += 1
            if time.time() - m.start > limit_s:
                os.killpg(proc.pid, 9)
                raise TimeoutError(f"{argv[:4]} ran past {limit_s:.0f} s; see {log}")
            time.sleep(SAMPLE_S)
        m.end, m.rc, m.sampler_cpu_s = time.time(), proc.returncode, time.process_time() - cpu0
    if m.rc != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} exited {m.rc}:\n{log.read_text()[-2000:]}")
    return m


def base_env() -> dict[str, str]:
    """The caller's environment without a torch thread cap: each side picks its own threads. The checkout first on
    the import path, then the caller's own entries (where TRL may come from)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    path = os.pathsep.join(p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p)
    return env | {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


# --- the two sides -------------------------------------------------------------------------------------------


@dataclass
class Side:
    name: str
    measured: Measured
    step_ends: list[float]  # wall clock at the end of each RL step
    rewards: list[float]  # mean reward per step
    notes: dict[str, object] = field(default_factory=dict)

    def figures(self) -> dict[str, float]:
        """The table's figures; steps are timed between step ends, so step 1 (warm caches, first batch) is left out."""
        m, ends = self.measured, self.step_ends
        gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)] or [float("nan")]
        k = min(5, len(self.rewards))
        return {
            "step": statistics.median(gaps),
            "loop": ends[-1] - ends[0],
            "whole": m.end - m.start,
            "first": ends[0] - m.start,
            "pss": m.peak_pss_mb,
            "reward_first": statistics.fmean(self.rewards[:k]),
            "reward_last": statistics.fmean(self.rewards[-k:]),
            "sampler_cpu": m.sampler_cpu_s,
        }


def rollflow_argv(publication: Path, out: Path, n_steps: int) -> list[str]:
    """`rollflow rl` on the peer workload from `publication` (version 0; the warm-up only publishes it)."""
    return [sys.executable, "-m", "rollflow.cli", "rl", "@", str(PROFILES[0]), "@", str(PEER_PROFILE),
            "--output-dir", str(out), "--max-steps", str(n_steps), "--model.path", str(publication),
            "--sft.steps", "0", "--overwrite"]  # fmt: skip


def rollflow_side(cfg, publication: Path, out: Path, n_steps: int) -> Side:
    argv = rollflow_argv(publication, out, n_steps)
    m = measure(argv, base_env(), out.with_suffix(".log"), limit_s=60 + 30 * n_steps)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward_mean" in r]
    check_rollflow_prompts(cfg, out, n_steps)
    return Side("rollflow async (tiny-cpu defaults)", m, [r["time"] for r in rows], [r["reward_mean"] for r in rows])


def check_rollflow_prompts(cfg, out: Path, n_steps: int) -> int:
    """The run's lake holds, step by step and group by group, exactly the prompts TRL is given."""
    import pyarrow.dataset as ds

    columns = ["step", "group_id", "prompt_text"]
    table = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table(columns)
    steps_, groups, texts = (table.column(c).to_pylist() for c in columns)
    seen = {(s, g): p for s, g, p in zip(steps_, groups, texts, strict=True)}
    mix = env_mix(cfg)
    got = sorted((s, p) for (s, _), p in seen.items())
    want = sorted((int(k.split("/")[0][5:]), mix.task(k).prompt) for k in prompt_keys(cfg, n_steps))
    if got != want:
        raise AssertionError(f"rollflow drew other prompts than TRL was given: {len(set(got) ^ set(want))} differ")
    return len(got)


def trl_side(cfg, publication: Path, out: Path, n_steps: int, threads: int | None) -> Side:
    out.mkdir(parents=True, exist_ok=True)
    spec = {"publication": str(publication), "out": str(out), "steps": n_steps, "threads": threads,
            "output_dir": str(cfg.output_dir), "lr": cfg.trainer.optim.lr, "betas": list(cfg.trainer.optim.betas),
            "batch_size": cfg.orchestrator.batch_size, "group_size": cfg.orchestrator.group_size,
            "max_new_tokens": cfg.orchestrator.max_new_tokens, "temperature": cfg.orchestrator.temperature,
            "max_grad_norm": cfg.trainer.optim.max_grad_norm}  # fmt: skip
    (out / "spec.json").write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "tests.bench.peer_trl", "--trl-child", str(out / "spec.json")]
    m = measure(argv, base_env(), out / "trl.log", limit_s=60 + 30 * n_steps)
    res = json.loads((out / "result.json").read_text())
    name = f"TRL GRPOTrainer, {res['threads']} thread{'s' if res['threads'] > 1 else ''}"
    return Side(name + (" (its default)" if threads is None else ""), m, res["step_ends"], res["rewards"],
                {"model": res["model"], "settings": res["settings"], "defaults": res["defaults"]})  # fmt: skip


# --- the TRL process (`--trl-child SPEC`) -----------------------------------------------------------------------


def trl_settings(spec: dict) -> dict[str, object]:
    """GRPOConfig: the workload's batch, length, optimizer and fp32; TRL's defaults for everything else."""
    return {
        "per_device_train_batch_size": spec["batch_size"] * spec["group_size"],  # completions per step: 32 x 8
        "num_generations": spec["group_size"],
        "max_completion_length": spec["max_new_tokens"],
        "temperature": spec["temperature"],
        "learning_rate": spec["lr"],
        "adam_beta2": spec["betas"][1],  # rollflow's AdamW betas (0.9, 0.99); TRL's default beta2 is 0.999
        "max_grad_norm": spec["max_grad_norm"],
        "lr_scheduler_type": "constant",  # rollflow's lr is constant; TRL's default decays it linearly to 0
        "max_steps": spec["steps"],
        "bf16": False,  # fp32 like rollflow (TRL defaults to bf16)
        "shuffle_dataset": False,  # rollflow's prompt order
        "seed": 0,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
    }


def trl_child(spec_path: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(spec_path.read_text())
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    cfg = run_config(Path(spec["output_dir"]))
    mix, keys = env_mix(cfg), prompt_keys(cfg, spec["steps"])
    rows = [{"prompt": [{"role": "user", "content": mix.task(k).prompt}], "key": k} for k in keys]
    rewards: list[float] = []
    order: list[str] = []

    def reward(prompts, completions, key, **_):
        out = []
        for p, c, k in zip(prompts, completions, key, strict=True):
            task = mix.task(k)
            assert p[-1]["content"] == task.prompt, (p, task)
            out.append(mix.reward(task, c[0]["content"]))
        order.extend(k for i, k in enumerate(key) if i % spec["group_size"] == 0)
        rewards.append(statistics.fmean(out))
        return out

    class StepClock(TrainerCallback):
        ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())

    settings = trl_settings(spec)
    args = GRPOConfig(output_dir=str(Path(spec["out"]) / "trl"), **settings)
    trainer = GRPOTrainer(model=spec["publication"], reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_list(rows), callbacks=[StepClock()])  # fmt: skip
    dtypes = {str(p.dtype) for p in trainer.model.parameters()}
    assert dtypes == {"torch.float32"}, dtypes
    trainer.train()
    assert order == keys, "TRL took the prompts in another order than rollflow's"
    defaults = {"gradient_checkpointing": args.gradient_checkpointing, "loss_type": args.loss_type, "beta": args.beta}
    result = {"step_ends": StepClock.ends, "rewards": rewards, "threads": torch.get_num_threads(),
              "model": type(trainer.model).__name__, "settings": settings, "defaults": defaults}  # fmt: skip
    (Path(spec["out"]) / "result.json").write_text(json.dumps(result))


# --- the section ------------------------------------------------------------------------------------------------


def run(ws: harness.Workspace, repeats: int | None = None, one_thread: bool = False) -> str:
    """Warm-up, checks, then each side once per repeat, interleaved (rollflow, TRL default[, TRL 1 thread], ...).
    `make bench` runs the two defaults; `--one-thread` adds TRL on one thread (rollflow's trainer has one)."""
    root = ws.root / "peer"
    cfg = run_config(root / "warmup")
    publication = harness.warm_up(cfg) / "weights" / "step=000000"
    n, mix = steps(), env_mix(cfg)
    check = check_same_model(publication, [mix.task(k).prompt for k in prompt_keys(cfg, 1)])
    sides: dict[str, list[Side]] = {}
    load = [os.getloadavg()[0]]
    for i in range(repeats or harness.repeats(1)):
        round_ = [
            rollflow_side(cfg, publication, root / f"rollflow{i}", n),
            trl_side(cfg, publication, root / f"trl-default{i}", n, threads=None),
        ]
        if one_thread:
            round_.append(trl_side(cfg, publication, root / f"trl-1thread{i}", n, threads=1))
        for side in round_:
            sides.setdefault(side.name, []).append(side)
        load.append(os.getloadavg()[0])
    return render(sides, check, n, load)


def _row(name: str, runs: list[Side]) -> list[str]:
    f = {k: harness.Stats([r.figures()[k] for r in runs]) for k in runs[0].figures()}
    return [name, f["step"].fmt(), f["loop"].fmt(unit=" s"), f["whole"].fmt(unit=" s"), f["first"].fmt(unit=" s"),
            f["pss"].fmt(unit=" MB"), f"{f['reward_first'].median:.3f} → {f['reward_last'].median:.3f}"]  # fmt: skip


def _ratios(ours: list[Side], peer: list[Side]) -> str:
    def r(key: str, inverse: bool = False) -> str:
        a, b = [s.figures()[key] for s in ours], [s.figures()[key] for s in peer]
        return (harness.ratio_stats(b, a) if inverse else harness.ratio_stats(a, b)).fmt(unit="x")

    return (f"rollflow against TRL's default, repeat by repeat: {r('step', inverse=True)} as fast per RL step "
            f"(goal ≥ 1.3x), {r('pss')} its peak memory (goal ≤ 1.5x), its first RL step after {r('first')} "
            f"TRL's time (goal ≤ 2x).")  # fmt: skip


def _intro(n: int, repeats: int, load: list[float], check: dict, model: object) -> str:
    loads = " / ".join(f"{x:.2f}" for x in load)
    return (
        f"{n} RL steps of 32 prompts x 8 samples, 12 new tokens, AdamW lr 1e-3, fp32; {repeats} run(s) per side, "
        f"interleaved; 1-minute load average {loads} (before, then after each round). Both sides start from the "
        f"same warm-up's version 0 ({model} in TRL). Checked before timing: identical logits on {check['prompts']} "
        f"prompts (max difference {check['max_logit_diff']:.2g}), identical prompt ids and decoding; checked after: "
        f"the same {n * 32} reverse-text prompts in the same order (rollflow's lake, TRL's reward function); the same "
        "reward (the environment's difflib similarity)."
    )


def _method(settings: dict, defaults: dict, sampler: float) -> str:
    def flags(d: dict) -> str:
        return ", ".join(f"`{k}={v}`" for k, v in d.items())

    return (
        "Each side's times start at its command: rollflow's `python -m rollflow.cli rl` (Prefect, MLflow, the three "
        "components; `--model.path` the version-0 publication and `--sft.steps 0`, so its warm-up process only "
        "publishes it), TRL's own process. Steps are timed end to end; the median leaves step 1 out. Memory: PSS "
        f"summed over the command's process tree every {SAMPLE_S} s (the sampler used at most {sampler:.1%} of a "
        f"core). TRL's GRPOConfig sets only the workload: {flags(settings)}; everything else is TRL's default, "
        f"among them {flags(defaults)}."
    )


def render(sides: dict[str, list[Side]], check: dict, n: int, load: list[float]) -> str:
    names = list(sides)
    ours, peer = sides[names[0]], sides[names[1]]
    headers = ["run", "s per RL step (median)", "RL loop (end of step 1 → N)", "whole process",
               "time to first RL step", "peak memory (PSS, all processes)", "reward first 5 → last 5"]  # fmt: skip
    settings, defaults = peer[0].notes["settings"], peer[0].notes["defaults"]
    assert isinstance(settings, dict) and isinstance(defaults, dict)
    runs = [s.figures() for group in sides.values() for s in group]
    sampler = max(f["sampler_cpu"] / max(f["whole"], 1e-9) for f in runs)
    table = harness.table(headers, [_row(name, group) for name, group in sides.items()])
    intro = _intro(n, len(ours), load, check, peer[0].notes["model"])
    return "\n\n".join([intro, table, _ratios(ours, peer), _method(settings, defaults, sampler)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.peer_trl", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps and a short warm-up: a smoke run")
    parser.add_argument("--repeats", type=int, help="rounds of the runs, interleaved (default 1)")
    parser.add_argument("--one-thread", action="store_true", help="also TRL on one thread in each round")
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_child:
        trl_child(args.trl_child)
        return 0
    if args.quick:
        os.environ["ROLLFLOW_BENCH_QUICK"] = "1"
        harness.QUICK = True
    with tempfile.TemporaryDirectory(prefix="rollflow-peer-") as tmp:
        print(f"## {TITLE}\n\n{run(harness.Workspace(Path(tmp)), args.repeats, args.one_thread)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
