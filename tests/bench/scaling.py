"""Benchmark 6: how one RL step's compute grows with group size, completion length and model width.

One step in-process, with the same code the processes run: `engines.inference.embedded.generate.generate` samples the
completions (fixed lengths: no end-of-sequence, so length is the controlled variable), then the trainer's
loss loop (`batch_logprobs`, `policy_loss`, backward over micro-batches of 64, AdamW step) trains on
them. One factor changes at a time from the baseline; each point is compared with the baseline measured
right before it.
"""

from __future__ import annotations

import math
import time

from tests.bench.harness import QUICK, Stats, Workspace, num, repeats, table

TITLE = "6. Scaling with work"
BASE = {"group_size": 8, "length": 12, "width": 192}
PROMPTS = 16
VARIANTS = [
    ("group_size", 4),
    ("group_size", 16),
    ("length", 6),
    ("length", 24),
    ("width", 96),
    ("width", 384),
]


def _model_cfg(width: int):
    from config.model import ModelConfig

    # Width scales hidden and MLP sizes together; depth and heads stay, so parameters grow ~width^2.
    return ModelConfig(hidden_size=width, intermediate_size=width * 8 // 3, num_layers=3, num_heads=4, num_kv_heads=2)


class Step:
    """A model, an optimizer and a trainer loop for one point; `__call__` times one RL step's compute."""

    def __init__(self, group_size: int, length: int, width: int):
        import torch

        from config.envs import EnvSpec
        from engines.environments.base import EnvMix
        from engines.models.decoder import CausalLM
        from engines.models.tokenizer import CharTokenizer

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.tok = CharTokenizer()
        self.cfg = _model_cfg(width)
        self.model = CausalLM(self.cfg, self.tok.vocab_size).eval()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        mix = EnvMix([EnvSpec(name="reverse-text")], seed=0)
        self.prompts = [self.tok.encode(mix.task(f"p{i}").prompt) for i in range(PROMPTS) for _ in range(group_size)]
        self.length = length
        self.tokens = sum(len(p) + length for p in self.prompts)  # sequence tokens the trainer sees

    def __call__(self) -> tuple[float, float]:
        import pyarrow as pa
        import torch
        from engines.trainer.loss import policy_loss

        from engines.inference.embedded.generate import generate
        from engines.trainer.batch import make_batch, micro_batches
        from engines.trainer.common import batch_logprobs

        n = len(self.prompts)
        t0 = time.perf_counter()
        outs = generate(
            self.model, self.prompts, max_new_tokens=[self.length] * n, temperatures=[1.0] * n,
            eos_id=-1, pad_id=self.tok.pad_id, seeds=list(range(n)),
        )  # fmt: skip
        t1 = time.perf_counter()
        batch = make_batch(
            pa.table(
                {
                    "prompt_ids": self.prompts,
                    "completion_ids": [c.token_ids for c in outs],
                    "completion_logprobs": [c.logprobs for c in outs],
                    "advantage": torch.randn(n).tolist(),
                    "temperature": [1.0] * n,
                    "policy_version": [0] * n,
                    "policy_version_end": [0] * n,
                }
            ),
            self.tok.pad_id,
        )
        self.model.train()
        tokens = float(batch.loss_mask.sum())
        for mb in micro_batches(batch, 64):
            lp = batch_logprobs(self.model, mb)
            policy_loss(lp, mb.sampler_logprobs, mb.advantages, mb.loss_mask, 0.5, 2.0, tokens).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.model.eval()
        return t1 - t0, time.perf_counter() - t1


def measure(n: int) -> list[dict]:
    base = Step(**BASE)
    base()  # first call pays one-time allocations
    points = []
    for key, value in VARIANTS[:2] if QUICK else VARIANTS:
        point = Step(**{**BASE, key: value})
        point()
        g_ratio, t_ratio, s_ratio = Stats(), Stats(), Stats()
        for _ in range(n):
            bg, bt = base()
            pg, pt = point()
            g_ratio.add(pg / bg)
            t_ratio.add(pt / bt)
            s_ratio.add((pg + pt) / (bg + bt))
        work = value / BASE[key]
        seq = point.tokens / base.tokens
        points.append(
            {"key": key, "value": value, "work": work, "seq": seq, "gen": g_ratio, "train": t_ratio, "step": s_ratio}
        )
    return points


def exponent(time_ratio: float, factor: float) -> float:
    """k in time ~ factor^k: 1 is linear, < 1 sublinear (fixed costs dominate), > 1 superlinear."""
    return math.log(time_ratio) / math.log(factor)


# The exponent compute-bound code would show: work grows with group size and length, and with the
# square of the width (parameters ~ width^2).
EXPECTED_K = {"group_size": 1.0, "length": 1.0, "width": 2.0}


def shape(key: str, k: float) -> str:
    """k against the compute-bound exponent: below it, per-step and per-operation overheads dominate."""
    r = k / EXPECTED_K[key]
    if r < 0.75:
        return "sublinear"
    if r > 1.25:
        return "superlinear"
    return "linear"


def _row(p: dict) -> list[str]:
    k_gen = exponent(p["gen"].median, p["work"])
    # generation grows with the new tokens, training with the sequence tokens (the prompts stay)
    k_train = exponent(p["train"].median, p["seq"] if p["key"] == "length" else p["work"])
    return [
        f"{p['key']} = {p['value']}",
        f"x{num(p['work'], 2)}",
        f"x{num(p['seq'], 2)}",
        p["gen"].fmt() + "x",
        p["train"].fmt() + "x",
        p["step"].fmt() + "x",
        f"{k_gen:.2f} / {k_train:.2f}",
        f"{shape(p['key'], k_gen)} / {shape(p['key'], k_train)}",
    ]


def report(points: list[dict]) -> str:
    rows = [_row(p) for p in points]
    headers = [
        "point",
        "factor",
        "sequence tokens",
        "gen time",
        "train time",
        "step time",
        "exponent k (gen / train)",
        "gen / train are",
    ]
    return table(headers, rows)


def run(ws: Workspace) -> str:
    intro = __doc__.split("\n\n", 1)[1]
    base = ", ".join(f"{k} = {v}" for k, v in BASE.items())
    return (
        f"{intro}\nBaseline: {PROMPTS} prompts, {base} (hidden size; MLP 8/3 x width, 3 layers). Each figure "
        "is the point's time over the baseline's, per repeat; exponent k = log(time ratio) / log(factor) "
        "(k = 1: linear; for width the factor is the width, so parameters grow ~ factor^2 and compute-bound "
        "code would show k ~ 2). 'gen / train are' compares each k with that compute-bound k (for length, "
        "training's k is over the sequence tokens, since prompts stay the same); sublinear means per-step "
        "or per-operation overheads dominate.\n\n" + report(measure(repeats(3)))
    )
