"""Trainer tokens/s and MFU for a Qwen3-0.6B-shaped model at 16k tokens on one GPU (docs/parallelism.md).

`python -m tests.bench.trainer_mfu --device cuda [--tokens 16384] [--peak-tflops 989]`: rollflow's model
(engines/models/decoder.py) in the Qwen3-0.6B shape, fp32 master weights with bf16 autocast, and full trainer steps:
forward, the trainer's logprobs (log-softmax over the vocabulary) and policy loss, backward, fused AdamW.
Prints one JSON line: tokens/s and MFU = (6 x params x tokens + causal attention FLOPs) / time / peak.
prime-rl's published figure for this setup on one H100: 11.9k tokens/s, 11.1% MFU.
`--device cpu --shape tiny` runs the same code on a toy shape to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import json
import time

TITLE = "Trainer MFU script (tests/bench/trainer_mfu.py): CPU check of the script"
QWEN3_0_6B = {
    "hidden_size": 1024, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
    "intermediate_size": 3072, "vocab_size": 151936, "max_seq_len": 40960, "rope_theta": 1e6,
    "qk_norm": True, "tie_word_embeddings": True,
}  # fmt: skip
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
        "vocab_size": 512, "max_seq_len": 4096, "qk_norm": True}  # fmt: skip


def flops_per_token(cfg, params: int, seq: int) -> float:
    """6N for the dense matmuls (forward + backward) plus causal attention: 6 x layers x seq x heads x head_dim
    (QK^T and AV, 2 FLOPs a multiply-add, x3 for backward, halved for causality)."""
    return 6 * params + 6 * cfg.num_layers * seq * cfg.num_heads * cfg.head_size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.trainer_mfu", description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (one sequence)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    args = ap.parse_args(argv)

    import torch

    from config.model import ModelConfig
    from config.trainer import TrainerConfig
    from engines.models.decoder import CausalLM
    from engines.trainer.losses.objective import Objective, StepCounts, TokenScores

    shape = QWEN3_0_6B if args.shape == "qwen3-0.6b" else TINY
    cfg = ModelConfig(**{k: v for k, v in shape.items() if k != "vocab_size"})
    vocab = int(shape["vocab_size"])  # type: ignore[call-overload]
    device = torch.device(args.device)
    model = CausalLM(cfg, vocab).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    ids = torch.randint(0, vocab, (1, args.tokens), device=device)
    mask = torch.ones(1, args.tokens - 1, device=device)
    adv = torch.ones(1, device=device)

    objective = Objective(TrainerConfig())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids)[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        scores = TokenScores(logp, logp.detach(), adv[:, None].expand_as(mask), mask, torch.zeros_like(ids[:, 1:]))
        objective(scores, StepCounts(float(mask.sum()), 1.0))[0].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    tps = args.tokens / dt
    mfu = tps * flops_per_token(cfg, params, args.tokens) / (args.peak_tflops * 1e12)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    print(json.dumps({"device": gpu, "shape": args.shape, "params": params, "tokens_per_step": args.tokens,
                      "step_s": dt, "tokens_per_s": tps, "mfu": mfu, "peak_mem_gib": peak_mem}))  # fmt: skip


def run(ws: object) -> str:
    """The runner's entry (`python -m tests.bench --every --quick`): the script on the toy shape on CPU, which
    checks the script and measures nothing (the figure is `--device cuda` on a GPU)."""
    from tests.bench import harness

    args = ["--device", "cpu", "--shape", "tiny", "--tokens", "256", "--steps", "2", "--warmup", "1"]
    return "```json\n" + harness.module_output("tests.bench.trainer_mfu", *args).strip() + "\n```"


if __name__ == "__main__":
    main()
