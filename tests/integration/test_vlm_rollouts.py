"""Image tasks through the orchestrator's own request paths against a real inference server on a tiny Qwen3-VL
(real HTTP on 127.0.0.1, the embedded engine in this process): a rollout group of count-shapes with two images is
sampled, scored and committed with its images, which read back from the shard with their checksums; a held-out
evaluation sends its images too. The server refuses a prompt whose image tokens come without their images (a
400), so samples coming back at all show that the images travelled with the expanded ids."""

from __future__ import annotations

import asyncio

import httpx
import pyarrow.dataset as ds

from config.eval import EvalConfig
from engines.environments.shapes import count_shapes
from engines.models.tokenizer import HFTokenizer
from engines.models.vision import image_runs
from engines.orchestrator.evaluation import Evaluator, make_spec
from storage import evals, rollouts
from storage.fs import get_fs
from tests.integration.test_vlm_server import serving
from tests.unit.test_orchestrator_images import _orchestrator
from tests.vlm_fixture import load, tiny_vlm_dir  # noqa: F401 (a fixture)


def test_a_rollout_group_and_an_evaluation_send_their_images(tiny_vlm_dir, tmp_path):  # noqa: F811
    with serving(load(tiny_vlm_dir), HFTokenizer(tiny_vlm_dir)) as client:
        url = str(client.base_url)
        orch = _orchestrator(tiny_vlm_dir, tmp_path, max_seq_len=64, url=url)
        rows = asyncio.run(orch.scored_group(1, 0))
        assert len(rows) == orch.ocfg.group_size and all(len(r.images or []) == 2 for r in rows)
        spec = orch.prompts.spec
        assert spec is not None and all([n for _, n in image_runs(r.prompt_ids, spec)] == [4, 4] for r in rows)
        fs, root = get_fs(str(tmp_path / "lake"))
        rollouts.write_step(fs, root, 1, rollouts.to_table(rows), {"dropped": 0})
        table = ds.dataset(f"{root}/rollouts", format="ipc", partitioning="hive").to_table()
        back = table.select(["images", "image_sha256"]).to_pylist()
        assert all(b["image_sha256"] == rollouts.image_digests(b["images"]) for b in back)

        env = count_shapes(images=2, eval_size=4)
        espec = make_spec(EvalConfig(num_tasks=4, block_tasks=2), ["two"], 0, 4, {"model": "tiny-vlm"})
        directory = f"{root}/evals/test"

        async def evaluate() -> dict:
            async with httpx.AsyncClient(base_url=url, timeout=60) as aclient:
                limit = asyncio.Semaphore(4)
                evaluator = Evaluator(aclient, limit, orch.tok, {"two": env}, espec, fs, directory, max_seq_len=64)
                return await evaluator.run()

        summary = asyncio.run(evaluate())
        assert summary["samples"] == 4
        prompts = evals.read_samples(fs, directory).column("prompt_ids").to_pylist()
        assert all([n for _, n in image_runs(p, spec)] == [4, 4] for p in prompts)
