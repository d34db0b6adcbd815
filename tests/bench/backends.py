"""Benchmark 8: the generation backends in one run: the embedded engine, vLLM CPU (0.32, the `vllm`
backend's server) and Hugging Face `generate()`, on the same model, prompts, group size and token budget.

Per model shape: our CausalLM (tiny: the benchmark warm-up's weights; larger shapes: random weights from
config) and the same weights in `LlamaForCausalLM` (tests/bench/inference.py's `Pair`) and, published as a
Hugging Face directory, in one vLLM server started from .venv-vllm exactly as the backend renders it
(eager mode). Each prompt is asked for `group` samples (one request with n = group, as the orchestrator
asks; every prompt's request in flight at once for vLLM, one batch for the engine and for HF), temperature
1, no top-k/top-p. Natural stop: end-of-sequence ends a row (tiny only: random weights rarely stop).
Fixed length: exactly `NEW_TOKENS` per row (engine: eos disabled; HF: min_new_tokens; vLLM: min_tokens =
max_tokens and ignore_eos). Then the weight update: a new publication loaded by each backend.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import time
from pathlib import Path

from engines.inference.embedded.packed import pack_linears
from tests.bench.harness import QUICK, Stats, Workspace, ratio_stats, repeats, table
from tests.bench.inference import WIDE, Case, Pair

TITLE = "8. Generation backends: embedded engine vs vLLM CPU vs HF generate()"
NEW_TOKENS = 24
LARGE = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 2048}
# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M's config.json; random weights, tied embeddings)
SMOL = LARGE | {"hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536}
SMOL |= {"vocab_size": 49152, "tie_word_embeddings": True}
SHAPES = [  # (name, model overrides, prompts, group, natural stop measured): ~1M, ~12M, ~76M, ~135M parameters
    ("tiny", {}, 32, 8, True),
    ("wide", WIDE, 16, 8, False),
    ("large", LARGE, 8, 8, False),
    ("smollm2", SMOL, 8, 8, False),
]
THREADS = "1"  # every backend on one core: torch threads for ours and HF, vLLM's OMP threads bound to core 0


def params(pair: Pair) -> float:
    return sum(p.numel() for p in pair.ours.parameters()) / 1e6


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publish(pair: Pair, files: dict[str, bytes], out: Path, version: int) -> None:
    """`pair.ours`'s weights as publication `version`, a Hugging Face directory like the trainer's."""
    from storage import weights
    from storage.fs import get_fs

    fs, root = get_fs(str(out))
    weights.publish(fs, root, version, pair.ours.publishable_state_dict(), files)


class VLLMServer:
    """One vLLM server on a publication, rendered and started as the vllm backend does."""

    def __init__(self, model_dir: Path, max_model_len: int, log: Path):
        from config.inference import InferenceConfig
        from engines.inference.vllm import processes as vllm
        from launch import vllm as vllm_launch

        port = free_port()
        shape = {"type": "single_node", "backend_port": port}
        cfg = InferenceConfig(backend="vllm", deployment=shape, vllm_extra={"enforce_eager": True})
        (replica,) = vllm_launch.render(
            cfg, str(model_dir), max_model_len, ["127.0.0.1"], vllm.vllm_python(cfg), False, str(vllm.WORKER_DIR)
        )
        (proc,) = replica.processes
        self.token = vllm.new_token()  # the server answers only requests that carry it, as in a run
        self.headers = {"Authorization": f"Bearer {self.token}"}
        env = {**vllm.process_env(proc, self.token), "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": THREADS}
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(proc.argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = replica.url
        self.start_s = vllm.wait_ready([self.url], [self.proc], 900)

    def stop(self) -> None:
        from engines.inference.vllm.processes import stop

        stop([self.proc])
        self.log.close()


async def _vllm_generate(server: VLLMServer, prompts: list[list[int]], group: int, tokens: int, fixed: bool) -> int:
    import httpx

    url = server.url
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), headers=server.headers) as client:

        async def one(i: int, prompt: list[int]) -> int:
            body = {"prompt": prompt, "n": group, "max_tokens": tokens, "temperature": 1.0, "seed": i}
            body |= {"min_tokens": tokens, "ignore_eos": True} if fixed else {}
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def vllm_generate(server: VLLMServer, pair: Pair, group: int, tokens: int, fixed: bool) -> tuple[float, int]:
    prompts = pair.prompts[::group]
    t0 = time.perf_counter()
    count = asyncio.run(_vllm_generate(server, prompts, group, tokens, fixed))
    return time.perf_counter() - t0, count


def vllm_update(server: VLLMServer, out: Path, version: int, cache: Path) -> tuple[float, float]:
    """(materialize s, pause + load on the worker + resume s): what the vLLM backend's /update_weights does."""
    import httpx

    from engines.inference.vllm.backend import Upstream, apply_update
    from engines.inference.vllm.processes import materialize
    from storage.fs import get_fs

    fs, root = get_fs(str(out))
    t0 = time.perf_counter()
    path = materialize(fs, root, version, cache) / "model.safetensors"
    t1 = time.perf_counter()

    async def apply() -> None:
        async with httpx.AsyncClient(timeout=600, headers=server.headers) as client:
            up = Upstream([server.url], [server.url], version - 1)
            up.open_gate.set()
            await apply_update(client, up, str(path), version)

    asyncio.run(apply())
    return t1 - t0, time.perf_counter() - t1


def engine_update(pair: Pair, out: Path, version: int) -> float:
    """What the embedded server's /update_weights does: read the publication, load it into the model."""
    from storage import weights
    from storage.fs import get_fs

    fs, root = get_fs(str(out))
    t0 = time.perf_counter()
    pair.ours.load_published(weights.load(fs, weights.version_dir(root, version)))
    return time.perf_counter() - t0


def measure_shape(ws: Workspace, name: str, model: dict, prompts: int, group: int, natural: bool, n: int) -> dict:
    import torch

    from engines.models import modeldir
    from tests.bench.harness import bench_config

    pair = Pair(ws, Case(name, prompts, group, workload=natural, model=model))
    mc = bench_config(ws.root / "inference").model.model_copy(update=model)
    files = modeldir.load(mc, pretrained=False).publication_files()
    out = ws.root / "backends" / name
    publish(pair, files, out, 0)
    from engines.inference.vllm.processes import materialize
    from storage.fs import get_fs

    cache = out / "vllm-cache"
    cache.mkdir(parents=True, exist_ok=True)
    fs, root = get_fs(str(out))
    model_dir = materialize(fs, root, 0, cache)
    server = VLLMServer(model_dir, mc.max_seq_len, out / "vllm.log")
    r: dict = {"name": name, "params_m": params(pair), "rows": len(pair.prompts), "start_s": server.start_s}
    r["roofline"] = roofline(pair, NEW_TOKENS)
    packed = copy.deepcopy(pair.ours)  # the engine with inference.onednn_linear (weights packed at its first call)
    pack_linears(packed)
    try:
        modes = [("natural", False, pair.new_tokens)] if natural else []
        modes.append(("fixed", True, NEW_TOKENS))
        for mode, fixed, tokens in modes:
            pair.eos = -1 if fixed else pair.tok.eos_id
            pair.hf.generation_config.eos_token_id = None if fixed else pair.tok.eos_id
            sides = {
                "engine": lambda t=tokens: pair.ours_generate(t),
                "onednn": lambda t=tokens: pair.ours_generate(t, packed),
                "hf": lambda t=tokens: pair.hf_generate(t),
                "vllm": lambda t=tokens, f=fixed: vllm_generate(server, pair, group, t, f),
            }
            for fn in sides.values():
                fn()  # first calls pay one-time set-up
            res: dict = {k: [] for k in sides}
            for _ in range(n):
                for key, fn in sides.items():
                    seconds, count = fn()
                    res[key].append((seconds, count))
            r[mode] = res
        updates: dict = {"engine": [], "vllm_materialize": [], "vllm_apply": []}
        for v in range(1, n + 1):
            with torch.no_grad():
                for p in pair.ours.parameters():
                    p.mul_(0.999)
            publish(pair, files, out, v)
            updates["engine"].append(engine_update(pair, out, v))
            m, a = vllm_update(server, out, v, cache)
            updates["vllm_materialize"].append(m)
            updates["vllm_apply"].append(a)
        r["updates"] = updates
    finally:
        server.stop()
    return r


def roofline(pair: Pair, tokens: int) -> float:
    """Tokens/s at this CPU's matmul peak: the best fp32 `mm` FLOP/s measured now at the decode step's shapes
    (the batch's rows x each Linear's) over one generated token's FLOPs (every Linear, lm_head included, and
    attention over the mean context of a fixed-length row). No generator on this core can run faster."""
    import torch

    from engines.trainer import flops

    rows = len(pair.prompts)  # every prompt already repeated `group` times
    context = sum(len(p) for p in pair.prompts) / rows + tokens / 2
    per_token = flops.step_flops(pair.ours, 1, context) / 3  # forward only: a third of forward + backward
    with torch.no_grad():
        peak = flops.matmul_peak(flops.linear_shapes(pair.ours), rows, torch.float32, min_s=0.2)
    return peak / per_token


def _tps(samples: list[tuple[float, int]]) -> list[float]:
    return [count / seconds for seconds, count in samples]


def report(results: list[dict]) -> str:
    rows = []
    for r in results:
        for mode in ("natural", "fixed"):
            if mode not in r:
                continue
            res = r[mode]
            eng, hf, vl, dnn = _tps(res["engine"]), _tps(res["hf"]), _tps(res["vllm"]), _tps(res["onednn"])
            per_row = " / ".join(f"{sum(c for _, c in res[k]) / len(res[k]) / r['rows']:.1f}" for k in res)
            rows.append(
                [
                    f"{r['name']} ({r['params_m']:.1f}M), {mode}",
                    Stats(eng).fmt(),
                    Stats(vl).fmt(),
                    Stats(hf).fmt(),
                    "**" + ratio_stats(eng, hf).fmt() + "x**",
                    "**" + ratio_stats(eng, vl).fmt() + "x**",
                    Stats(dnn).fmt(),
                    "**" + ratio_stats(dnn, vl).fmt() + "x**",
                    f"{r['roofline']:,.0f}",
                    f"{r['roofline'] / Stats(hf).median:.2f}x",
                    per_row,
                ]
            )
    headers = ["model, stop", "engine tok/s", "vLLM CPU tok/s", "HF tok/s", "engine / HF", "engine / vLLM"]
    headers += ["engine + oneDNN tok/s", "engine + oneDNN / vLLM", "roofline tok/s", "roofline / HF"]
    headers += ["tokens / row (engine / oneDNN / HF / vLLM)"]
    upd = [
        [
            f"{r['name']} ({r['params_m']:.1f}M)",
            Stats([t * 1000 for t in r["updates"]["engine"]]).fmt(unit=" ms"),
            Stats([t * 1000 for t in r["updates"]["vllm_materialize"]]).fmt(unit=" ms"),
            Stats([t * 1000 for t in r["updates"]["vllm_apply"]]).fmt(unit=" ms"),
            f"{r['start_s']:.0f} s",
        ]
        for r in results
    ]
    upd_headers = ["model", "engine: read + load", "vLLM: materialize", "vLLM: pause + load + resume", "vLLM start"]
    return (
        table(headers, rows)
        + "\n\nWeight update (a new publication, served by each backend):\n\n"
        + table(upd_headers, upd)
    )


DEFINITIONS = f"""\
Engine: `engines.inference.embedded.generate.generate` in this process (the function the engine's worker runs;
no HTTP). vLLM: one server (`python -m vllm.entrypoints.openai.api_server`, the backend's rendered command
with `--enforce-eager`), timed from this process over HTTP (requests, detokenization and the HTTP layer are
inside its figure), one OMP thread bound to core 0 (`VLLM_CPU_OMP_THREADS_BIND=0`). HF:
`LlamaForCausalLM.generate`. Engine + oneDNN: the same engine with `inference.onednn_linear` (its Linear
layers on oneDNN packed weights, engines/inference/embedded/packed.py). Each backend on one thread. tokens/s =
generated tokens / wall time of the whole batch (vLLM: `usage.completion_tokens`). Fixed = {NEW_TOKENS} tokens
per row. Shapes: tiny = the workload's model (hidden 192, 3 layers); wide = hidden 512, 4 layers, MLP 1536;
large = hidden 768, 12 layers, 12 heads (4 KV), MLP 2048; smollm2 = SmolLM2-135M's shape (hidden 576, 30
layers, 9 heads (3 KV), MLP 1536, vocabulary 49,152, tied embeddings), random weights. Weight update: engine =
`weights.load` + `load_published` (what its /update_weights runs after the HTTP call); vLLM = `materialize`
(publication -> local safetensors) and the vLLM backend's `apply_update` (pause keep, `collective_rpc`
rollflow_load, resume) over HTTP.
Roofline: the tokens/s one core would reach if every generated token's FLOPs (each Linear, lm_head included,
2 FLOPs per weight; attention over the mean context) ran at the best fp32 `torch.mm` rate measured in this run
at the decode step's shapes (rows x each Linear); roofline / HF is then the most any generator could gain over
`generate()` on this core (engines/trainer/flops.py's counts and peak).
"""


def run(ws: Workspace) -> str:
    from engines.inference.vllm.processes import ROOT

    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        return "Skipped: no vLLM environment (`make vllm`)."
    n = repeats(3)
    shapes = SHAPES[:1] if QUICK else SHAPES
    results = [measure_shape(ws, *shape, n=n) for shape in shapes]
    return __doc__.split("\n\n", 1)[1] + "\n" + DEFINITIONS + "\n" + report(results)


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(run(Workspace(Path(tmp))))
    sys.exit(0)
