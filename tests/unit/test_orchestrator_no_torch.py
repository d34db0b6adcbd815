"""The orchestrator process never imports torch. In a fresh interpreter: its entry module and every
environment module it may load import no torch; then, with torch made unimportable as the process's `main`
does (`forbid_torch`), its run path for each kind of model and environment runs (model directory resolved,
tokenizer loaded, environment mix built, tasks drawn and rendered, a group scored and given its advantages,
an episode run against scripted choices, the rows made an Arrow table), so nothing on it needs torch. Only
the HTTP calls to the inference server are left out (httpx and pydantic). A Hugging Face tokenizer loaded
there (transformers believing torch absent) tokenizes exactly as in a process with torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RUN_PATH = r"""
import json, sys

def check(where):
    if "torch" in sys.modules:
        print(json.dumps({"torch_after": where}))
        sys.exit(0)

import engines.orchestrator.loop
check("import engines.orchestrator.loop")
for name in ("base", "episodes", "plugins", "tools", "longhop", "rgym", "verifiers_env", "verifiers_client", "shapes"):
    __import__(f"engines.environments.{name}")
    check(f"import engines.environments.{name}")
engines.orchestrator.loop.forbid_torch()  # as main() does: from here on, `import torch` fails

import asyncio, random
import httpx
from config.loader import load_run_config
from config.process import component_configs
from engines.environments.episodes import is_multi_turn, run_episode
from engines.orchestrator.advantages import with_group_advantages
from engines.orchestrator.loop import Orchestrator, WeightSync
from engines.protocol import CompletionChoice, CompletionLogprobs
from storage import rollouts
from storage.fs import Storage

def choice(tok, text):
    ids = tok.encode(text, bos=False) + [tok.eos_id]
    lps = CompletionLogprobs(tokens=[""] * len(ids), token_logprobs=[-0.5] * len(ids))
    return CompletionChoice(index=0, text=text, finish_reason="stop", logprobs=lps, token_ids=ids,
                            policy_version=0, policy_version_end=0)

def run_case(profile, overrides, out):
    cfg = load_run_config([profile], [("output-dir", out), *overrides])
    ocfg = component_configs(cfg, "run-1", "http://127.0.0.1:9")["orchestrator"]
    fs, root = Storage(ocfg.run.storage).open(ocfg.run.output_dir)
    orch = Orchestrator(ocfg, httpx.AsyncClient(base_url=ocfg.inference_url), WeightSync(None, fs, root, "", 1.0))
    tok, rows = orch.tok, []
    for group in range(4):
        task = orch.mix.task(f"step=1/group={group}")
        env = orch.mix.envs[task.env]
        if is_multi_turn(env):
            async def sample(request, session):
                return choice(tok, "?" + task.prompt[:2])
            build = orch.episodes.request(1, group, 0)
            episode = asyncio.run(run_episode(env, task, tok, sample, build, "run-1/s", ocfg.model.max_seq_len))
            scored = [episode.row(task, "run-1", 1, f"g{group}-0", f"g{group}", reward=env.score(task, episode.replies),
                                  temperature=1.0)]
        else:
            choices = [choice(tok, "ab"), choice(tok, "c")]
            prompt = orch.prompts.render(task)  # with its images expanded, for the vision-language model
            assert prompt is not None and len(prompt.images) == len(task.images)
            scored = orch.score_group(f"g{group}", 1, task, prompt, choices)
        rows += with_group_advantages(scored, True)
    rollouts.to_table(rows)
    chat = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}, {"role": "user", "content": "c"}]
    return {"prompt": tok.render_prompt("abc"), "chat": tok.render_messages(chat),
            "decoded": tok.decode(tok.encode("hello<eos>"), skip_special=False)}

seen = [run_case(*case) for case in json.loads(sys.argv[1])]
print(json.dumps({"torch_after": None if sys.modules["torch"] is None else "the run path", "tokenized": seen}))
"""


def _publish(out: Path, **shape) -> str:
    """A Hugging Face model directory of rollflow's built-in model (as `weights/step=0/` is one)."""
    import torch

    from config.model import ModelConfig
    from engines.models import modeldir
    from storage import weights
    from storage.fs import get_fs

    torch.manual_seed(0)
    loaded = modeldir.load(ModelConfig(**shape), pretrained=False)
    fs, root = get_fs(str(out))
    return weights.publish(fs, root, 0, loaded.model.publishable_state_dict(), loaded.publication_files())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("models")
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "qk_norm": True, "hidden_size": 32, "num_layers": 1}
    dirs = {"dense": _publish(base / "dense", hidden_size=32, num_layers=1), "moe": _publish(base / "moe", **moe)}
    from engines.models import tiny_vlm

    dirs["vlm"] = str(tiny_vlm.write(base / "vlm"))
    # another chat template makes the MoE directory's tokenizer a Hugging Face one (the dense one stays the
    # built-in character tokenizer, as for any publication of the built-in model): both paths run without torch
    config = Path(dirs["moe"]) / "tokenizer_config.json"
    config.write_text(config.read_text().replace("={% endif %}", ">{% endif %}"))
    return dirs


def test_the_orchestrator_process_does_not_import_torch(tmp_path, model_dirs):
    cases = [
        ("profiles/tiny-cpu.toml", []),
        ("profiles/tiny-tools-cpu.toml", []),
        ("profiles/tiny-moe-cpu.toml", []),
        ("profiles/tiny-cpu.toml", [("model.path", model_dirs["dense"])]),
        ("profiles/tiny-cpu.toml", [("model.path", model_dirs["moe"])]),
        ("profiles/tiny-cpu.toml", [("model.path", model_dirs["vlm"]), ("envs", '[{id = "count-shapes"}]')]),
    ]
    cases = [(p, o, str(tmp_path / f"run{i}")) for i, (p, o) in enumerate(cases)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", RUN_PATH, json.dumps(cases)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdict["torch_after"] is None, f"torch was imported by {verdict['torch_after']}"
    from config.model import ModelConfig
    from engines.models import modeldir
    from engines.models.tokenizer import CharTokenizer

    kinds = []
    for (_, overrides, _), seen in zip(cases, verdict["tokenized"], strict=True):
        if overrides:  # the same tokenizer with torch loaded (this process)
            tok = modeldir.load_tokenizer(modeldir.resolve(ModelConfig(path=dict(overrides)["model.path"])))
            kinds.append(isinstance(tok, CharTokenizer))
            assert seen["prompt"] == tok.render_prompt("abc")
            chat = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]
            assert seen["chat"] == tok.render_messages([*chat, {"role": "user", "content": "c"}])
            assert seen["decoded"] == tok.decode(tok.encode("hello<eos>"), skip_special=False)
    assert kinds == [True, False, False]


FLOW_PATH = r"""
import json, sys
from rollflow.cli import main

profile, dry, out = sys.argv[1:]
assert main(["rl", "@", profile, "--output-dir", dry, "--dry-run"]) == 0  # every load-time check, configs written
import flows.rl, flows.sft, runtime.local_api, tasks.components  # what `rollflow rl` imports to start the flow
from config.loader import load_run_config
from runtime.lifecycle import close_run, start_new_run

cfg = load_run_config([profile], [("output-dir", out)])
run = start_new_run(cfg, overwrite=False)  # with its MLflow run, made in a child process
close_run(cfg, run, "finished")
print(json.dumps({"mlflow_run_id": run.state.mlflow_run_id,
                  "loaded": [m for m in ("torch", "transformers", "mlflow") if m in sys.modules]}))
"""


def test_the_cli_and_flow_process_does_not_import_torch_or_mlflow(tmp_path):
    """The process that runs `rollflow rl` (its checks, the flow, the run's bookkeeping) lives as long as the run
    and computes nothing: torch, transformers and MLflow (hundreds of MB, tests/bench/memory.py) stay out of it.
    The MLflow run is made and closed all the same, by runtime/tracking.py's child process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(HF_HUB_OFFLINE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    out = tmp_path / "run"
    argv = [sys.executable, "-c", FLOW_PATH, "profiles/tiny-cpu.toml", str(tmp_path / "dry"), str(out)]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdict["loaded"] == [], f"the CLI/flow process imported {verdict['loaded']}"
    from mlflow.tracking import MlflowClient

    finished = MlflowClient(f"sqlite:///{out}/mlflow.db").get_run(verdict["mlflow_run_id"])
    assert finished.info.status == "FINISHED" and finished.data.tags["rollflow.run_id"]
