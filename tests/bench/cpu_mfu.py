"""The trainer against this CPU's measured peak: matmul FLOP/s at the model's shapes, and a trainer step's MFU.

`python -m tests.bench.cpu_mfu [--quick]` prints its markdown section; `make bench` includes it (`mfu`).

Peak: `torch.mm` of [tokens, in] x [in, out] for every distinct Linear shape of the model (the shapes a trainer
step multiplies), fp32 and bf16, with 1 and 2 threads, timed until 0.3 s have passed; the peak is the best of those.
A trainer step is rollflow's model (engines/models/decoder.py) doing what engines/trainer/rl.py does per
micro-batch: forward, the trainer's logprobs (log-softmax over the vocabulary), the default policy loss, backward,
gradient clipping and AdamW, fp32 and bf16 (`trainer.compute_dtype`: the forward on bf16-cast parameters), the
median of 2 steps after a warm-up. MFU = the step's matmul FLOPs (engines/trainer/flops.py: 6 x Linear parameters +
causal attention, per token) / step time / the peak of the same dtype and threads. bf16 is measured only where a
small bf16 matmul beats fp32 (`bf16_probe`): on a CPU without bf16 matmul units (AVX2 only, no AVX512-BF16 or
AMX) it is ~30x slower and one step of SmolLM2's shape takes minutes.
Shapes: the tiny model of profiles/tiny-cpu.toml at its micro-batch (64 rows of 32 tokens) and SmolLM2-135M's
shape (random weights: the FLOPs do not depend on them) at 8 rows of 128 tokens.
"""

from __future__ import annotations

import argparse
import time

from tests.bench.harness import QUICK, Workspace, num, table

TITLE = "Trainer MFU against this CPU's measured matmul peak"

SHAPES = {
    "tiny (1.2M)": ({"hidden_size": 192, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512,
                     "max_seq_len": 64}, 260, (64, 32)),
    "SmolLM2-135M shape": ({"hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3,
                            "intermediate_size": 1536, "max_seq_len": 2048, "tie_word_embeddings": True},
                           49152, (8, 128)),
}  # fmt: skip


def _model(shape: dict, vocab: int):
    import torch

    from config.model import ModelConfig
    from engines.models.decoder import CausalLM

    torch.manual_seed(0)
    return CausalLM(ModelConfig(**shape), vocab)


def train_step_s(model, rows: int, seq: int, bf16: bool, steps: int) -> float:
    """Median seconds of one full trainer step on [rows, seq] tokens."""
    import statistics

    import torch

    from config.trainer import TrainerConfig
    from engines.trainer.common import forward_precision
    from engines.trainer.losses.objective import Objective, StepCounts, TokenScores

    vocab = model.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, vocab, (rows, seq))
    mask, adv = torch.ones(rows, seq - 1), torch.ones(rows, seq - 1)
    sequence = torch.arange(rows)[:, None].expand(rows, seq - 1)  # one sample per row
    objective = Objective(TrainerConfig())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with forward_precision(model, "bfloat16" if bf16 else "float32"):  # trainer.compute_dtype's forward
            logits = model(ids)[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        scores = TokenScores(logp, logp.detach(), adv, mask, sequence)
        objective(scores, StepCounts(float(mask.sum()), float(rows)))[0].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()  # warm-up: AdamW's state, first-call kernel choices
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bf16_probe() -> dict[str, float]:
    """FLOP/s of one [256, 256] x [256, 256] matmul per dtype, one thread: whether bf16 has matmul units here."""
    import torch

    from engines.trainer.flops import matmul_peak

    torch.set_num_threads(1)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {d: matmul_peak({(256, 256)}, 256, t, 0.05) for d, t in dtypes.items()}


def measure(quick: bool) -> dict:
    """{"rows": one per model, threads and dtype measured; "probe": `bf16_probe()`}. bf16 is measured only where
    its probe beats fp32: without bf16 matmul units (AVX2 only) one bf16 step of SmolLM2's shape takes minutes."""
    import torch

    from engines.trainer.flops import linear_shapes, matmul_peak, step_flops

    probe = bf16_probe()
    dtypes = {"fp32": torch.float32} | ({"bf16": torch.bfloat16} if probe["bf16"] > probe["fp32"] else {})
    min_s, steps = (0.05, 1) if quick else (0.3, 2)
    rows_out = []
    for name, (shape, vocab, (rows, seq)) in SHAPES.items():
        if quick and "SmolLM2" in name:
            rows, seq = 2, 32
        model = _model(shape, vocab)
        shapes = linear_shapes(model)
        flops = step_flops(model, rows * seq, seq)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for dtype, torch_dtype in dtypes.items():
                peak = matmul_peak(shapes, rows * seq, torch_dtype, min_s)
                step_s = train_step_s(model, rows, seq, dtype == "bf16", steps)
                rows_out.append({"model": name, "threads": threads, "dtype": dtype, "tokens": rows * seq,
                                 "peak": peak, "step_s": step_s, "achieved": flops / step_s,
                                 "mfu": flops / step_s / peak})  # fmt: skip
    torch.set_num_threads(1)
    return {"rows": rows_out, "probe": probe}


def report(results: dict) -> str:
    rows = [
        [r["model"], r["threads"], r["dtype"], r["tokens"], num(r["peak"] / 1e9) + " GFLOP/s",
         num(r["step_s"] * 1e3) + " ms", num(r["achieved"] / 1e9) + " GFLOP/s", f"{r['mfu']:.1%}"]
        for r in results["rows"]
    ]  # fmt: skip
    head = ["model", "threads", "dtype", "tokens/step", "measured matmul peak", "trainer step", "achieved", "MFU"]
    probe = results["probe"]
    bf16 = (
        f"a 256x256x256 matmul on one thread runs at {num(probe['fp32'] / 1e9)} GFLOP/s in fp32 and "
        f"{num(probe['bf16'] / 1e9)} in bf16"
    )
    if probe["bf16"] <= probe["fp32"]:
        bf16 += ": this CPU has no bf16 matmul units, so the bf16 rows were not measured"
    return (
        "Peak: the best `torch.mm` FLOP/s over the model's Linear shapes at the step's token count; a trainer step: "
        "forward, logprobs, the default loss, backward, clipping, AdamW (`python -m tests.bench.cpu_mfu`). bf16: "
        + bf16
        + ".\n\n"
        + table(head, rows)
    )


def run(ws: Workspace) -> str:
    return report(measure(QUICK))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.cpu_mfu", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny repeats and a small SmolLM2 batch: a smoke run")
    args = ap.parse_args(argv)
    print(report(measure(args.quick or QUICK)))


if __name__ == "__main__":
    main()
