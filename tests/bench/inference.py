"""Benchmark 2: the embedded engine's generation against Hugging Face transformers' `generate()`.

Same model (our CausalLM's weights loaded into `LlamaForCausalLM`, which the parity tests show gives
equal logits), same prompts, same batch (each prompt repeated `group_size` times, as the orchestrator
asks), same sampling (temperature 1, no top-k/top-p), same fixed number of new tokens (end-of-sequence
disabled on both sides so both produce exactly the same token count), one torch thread each.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from tests.bench.harness import QUICK, Stats, Workspace, bench_config, ratio_stats, repeats, table

TITLE = "2. Inference engine vs Hugging Face generate()"
WIDE = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "intermediate_size": 1536}


@dataclass
class Case:
    label: str
    prompts: int
    group: int
    workload: bool = False  # warm-up weights, stop at end-of-sequence, the workload's max_new_tokens
    model: dict = field(default_factory=dict)  # overrides of the workload's model shape


CASES = [
    Case("workload: warm-up weights, 32 prompts x 8, stop at eos", 32, 8, workload=True),
    Case("fixed 24 tokens, 32 prompts x 8", 32, 8),
    Case("fixed 24 tokens, 1 prompt x 1", 1, 1),
    Case("fixed 24 tokens, wide model, 8 prompts x 8", 8, 8, model=WIDE),
]
NEW_TOKENS = 24


class Pair:
    """Our model and the HF Llama with the same weights, plus the batch both sample."""

    def __init__(self, ws: Workspace, case: Case):
        import torch
        import transformers

        from engines.environments.base import EnvMix
        from engines.models.decoder import CausalLM
        from engines.models.tokenizer import CharTokenizer
        from storage import weights
        from storage.fs import get_fs

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch.set_num_threads(1)
        cfg = bench_config(ws.root / "inference")
        mc = cfg.model.model_copy(update=case.model)
        self.tok = CharTokenizer()
        torch.manual_seed(0)
        vocab = mc.vocab_size or self.tok.vocab_size  # a shape may set its own (SmolLM2's 49,152)
        self.ours = CausalLM(mc, vocab).eval()
        if case.workload:
            fs, root = get_fs(str(ws.template()))
            self.ours.load_published(weights.load(fs, weights.version_dir(root, 0)))
        self.eos = self.tok.eos_id if case.workload else -1
        self.new_tokens = cfg.orchestrator.max_new_tokens if case.workload else NEW_TOKENS
        self.hf = transformers.LlamaForCausalLM(hf_config(mc, vocab)).eval()
        self.hf.load_state_dict(self.ours.publishable_state_dict(), strict=False)  # lm_head is tied
        # eos off means fixed-length outputs on both sides (eos_id=-1 on ours)
        self.hf.generation_config.eos_token_id = self.tok.eos_id if case.workload else None
        self.hf.generation_config.pad_token_id = self.tok.pad_id
        mix = EnvMix(cfg.envs, cfg.seed)
        texts = [mix.task(f"bench/{i}").prompt for i in range(case.prompts)]
        self.prompts = [self.tok.encode(t) for t in texts for _ in range(case.group)]

    def ours_generate(self, new_tokens: int, model=None) -> tuple[float, int]:
        """(seconds, tokens generated) of `model` (default: ours)."""
        from engines.inference.embedded.generate import generate

        n = len(self.prompts)
        t0 = time.perf_counter()
        outs = generate(
            model or self.ours, self.prompts, max_new_tokens=[new_tokens] * n, temperatures=[1.0] * n,
            eos_id=self.eos, pad_id=self.tok.pad_id, seeds=list(range(n)),
        )  # fmt: skip
        return time.perf_counter() - t0, sum(len(c.token_ids) for c in outs)

    def hf_generate(self, new_tokens: int) -> tuple[float, int]:
        """(seconds, tokens generated: each row's up to and including its first eos)."""
        import torch

        from engines.inference.embedded.prefill import left_pad

        ids, valid = left_pad(self.prompts, self.tok.pad_id)
        fixed = self.eos < 0
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.hf.generate(
                input_ids=ids, attention_mask=valid.long(), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens if fixed else None,
            )  # fmt: skip
        elapsed = time.perf_counter() - t0
        new = out[:, ids.shape[1] :]
        if fixed:
            return elapsed, new.numel()
        is_eos = (new == self.eos).int()
        ended = is_eos.cumsum(-1) - is_eos > 0  # positions after a row's first eos are padding
        return elapsed, int((~ended).sum())


def hf_config(mc, vocab_size: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.num_kv_heads,
        max_position_embeddings=mc.max_seq_len,
        rope_theta=mc.rope_theta,
        rms_norm_eps=mc.rms_norm_eps,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    )


def measure(ws: Workspace, n: int) -> list[dict]:
    results = []
    for case in CASES[:2] if QUICK else CASES:
        pair = Pair(ws, case)
        pair.ours_generate(2), pair.hf_generate(2)  # first calls pay one-time set-up
        calls = {
            "ours": (pair.ours_generate, pair.new_tokens),
            "hf": (pair.hf_generate, pair.new_tokens),
            "ours_ttft": (pair.ours_generate, 1),
            "hf_ttft": (pair.hf_generate, 1),
        }
        r: dict = {"case": case, "rows": len(pair.prompts), **{k: [] for k in calls}}
        r.update({k + "_tokens": [] for k in calls})
        for _ in range(n):
            for key, (fn, tokens) in calls.items():
                seconds, count = fn(tokens)
                r[key].append(seconds)
                r[key + "_tokens"].append(count)
        results.append(r)
    return results


def report(results: list[dict]) -> str:
    rows = []
    for r in results:
        ours = [k / t for k, t in zip(r["ours_tokens"], r["ours"], strict=True)]
        hf = [k / t for k, t in zip(r["hf_tokens"], r["hf"], strict=True)]
        rows.append(
            [
                r["case"].label,
                Stats(ours).fmt(),
                Stats(hf).fmt(),
                "**" + ratio_stats(ours, hf).fmt() + "x**",
                Stats([t * 1000 for t in r["ours_ttft"]]).fmt(unit=" ms"),
                Stats([t * 1000 for t in r["hf_ttft"]]).fmt(unit=" ms"),
                ratio_stats(r["hf_ttft"], r["ours_ttft"]).fmt() + "x",
                " / ".join(f"{statistics.mean(r[k]) / r['rows']:.1f}" for k in ("ours_tokens", "hf_tokens")),
            ]
        )
    headers = [
        "case",
        "engine tokens/s",
        "HF tokens/s (baseline)",
        "speedup",
        "engine TTFT",
        "HF TTFT",
        "TTFT speedup",
        "tokens / row (engine / HF)",
    ]
    return table(headers, rows) + "\n\nTarget: speedup >= 3x for batched sampling with groups (first two rows)."


DEFINITIONS = f"""\
Engine: `engines.inference.embedded.generate.generate`, which drives the same `Decoder` (prefill, sample, forward) as
the engine's worker, on one fixed batch; the HTTP layer, the queue and mid-batch joins are not included. HF:
`LlamaForCausalLM.generate(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)` with its dynamic KV
cache and SDPA attention. tokens/s = tokens generated / time, where a row's tokens end at its first
end-of-sequence. Workload row: the benchmark warm-up's weights and prompts (long-tailed lengths),
`max_new_tokens` = 26, both stop a row at end-of-sequence, so token counts differ a little by chance
(last column). Fixed rows: random weights, end-of-sequence disabled on both sides (exactly {NEW_TOKENS}
tokens per row). TTFT (time to first token) = the same call with one new token: prefill of the whole
batch plus one sampling step (the compute floor of a batch's first token; the server streams each token
as it is drawn). wide = hidden 512, 4 layers, MLP 1536 (12.1M parameters); tiny = the workload's model
(1.2M).
"""


ARRIVAL = {"background": 32, "group": 8, "background_tokens": 48, "probe_tokens": 8, "after_steps": 12}


def arrival_once(ws: Workspace, continuous: bool) -> dict[str, float]:
    """One request (n = group) arrives while a batch of `background` x `group` rows is decoding (after
    `after_steps` of its steps): its latency to first token and to completion, and the background's tokens/s."""
    import threading

    import torch

    from engines.inference.embedded.engine import Engine, Request
    from engines.models.decoder import CausalLM
    from engines.models.tokenizer import CharTokenizer

    torch.set_num_threads(1)
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = CausalLM(bench_config(ws.root / "arrival").model, tok.vocab_size)
    a = ARRIVAL
    engine = Engine(model, 0, -1, tok.pad_id, max_batch_size=1024, seed=0, continuous=continuous)
    marks: dict[str, float] = {}
    started = threading.Event()

    def make(text: str, tokens: int, on_tokens=None) -> Request:
        return Request(tok.encode(text), a["group"], tokens, 1.0, seed=1, on_tokens=on_tokens)

    def count_steps(events) -> None:
        marks["steps"] = marks.get("steps", 0) + 1
        if marks["steps"] == a["after_steps"]:
            started.set()

    def first_token(events) -> None:
        marks.setdefault("first", time.perf_counter())

    background = [make(f"rev:{i:03d}abcdefgh=", a["background_tokens"]) for i in range(a["background"])]
    background[0].on_tokens = count_steps
    t0 = time.perf_counter()
    with engine._cv:  # queued together, so both engines start with the whole background batch
        futures = [engine.submit(r) for r in background]
    started.wait(600)
    probe = make("sort:qwerty=", a["probe_tokens"], first_token)
    arrived = time.perf_counter()
    probe_done = engine.submit(probe)
    probe_done.result(600)
    done = time.perf_counter()
    tokens = sum(len(c.token_ids) for f in futures for c in f.result(600))
    background_s = time.perf_counter() - t0
    engine.stop()
    engine._thread.join(10)
    return {"ttft": marks["first"] - arrived, "latency": done - arrived, "background": tokens / background_s}


def arrival(ws: Workspace, n: int) -> str:
    runs = {mode: [arrival_once(ws, mode == "continuous") for _ in range(n)] for mode in ("static", "continuous")}

    def col(mode: str, key: str) -> list[float]:
        return [r[key] for r in runs[mode]]

    rows = []
    for key, label, unit in (("ttft", "time to first token", " ms"), ("latency", "time to completion", " ms")):
        static, cont = ([v * 1000 for v in col(m, key)] for m in ("static", "continuous"))
        rows.append([label, Stats(static).fmt(unit=unit), Stats(cont).fmt(unit=unit),
                     ratio_stats(static, cont).fmt() + "x"])  # fmt: skip
    static, cont = col("static", "background"), col("continuous", "background")
    rows.append(
        ["running batch tokens/s", Stats(static).fmt(), Stats(cont).fmt(), ratio_stats(cont, static).fmt() + "x"]
    )
    a = ARRIVAL
    intro = (
        f"\n\n### A request that arrives mid-batch (continuous batching vs the static batcher)\n\n"
        "`engines.inference.embedded.engine.Engine` with `continuous=True` (the server's engine) and `False` "
        "(requests wait for the running batch to end, the engine before continuous batching), same model "
        f"(the workload's, random weights, no end-of-sequence), one thread: {a['background']} requests "
        f"x n={a['group']} of {a['background_tokens']} tokens are decoding; after {a['after_steps']} of "
        f"their steps one request (n={a['group']}, {a['probe_tokens']} tokens) arrives. Its latency from "
        "submit to its first token and to its completion; the running batch's tokens/s (all its tokens / its "
        "wall time) shows what admitting the newcomer costs the others. Ratios: static / continuous for "
        "latencies, continuous / static "
        f"for tokens/s.\n\n"
    )
    return intro + table(["", "static batcher (baseline)", "continuous", "ratio"], rows)


def run(ws: Workspace) -> str:
    body = __doc__.split("\n\n", 1)[1] + "\n" + DEFINITIONS + "\n" + report(measure(ws, repeats(3)))
    return body + arrival(ws, repeats(3))
