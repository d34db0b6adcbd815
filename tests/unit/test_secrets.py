"""Secrets stay out of everything a run writes or shows (config/redact.py), vLLM's environment names them by
reference and receives their values at launch only, and inference is placed where its clients reach it.

A planted value is searched for in every file under the run directory, in the MLflow params of a real sqlite
store, in the rendered plan and commands and in the batch script `--dry-run` writes.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from config.redact import redact_env, redact_url
from config.run import RunConfig
from engines.inference.backend import launch_plan
from engines.inference.vllm import processes
from launch import vllm as vllm_launch
from runtime.rundir import public_config, write_configs

TINY = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.toml"
PLANTED = "planted-7f3a9c"


def files_holding(root: Path, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://u:pw@h/x?token=abc&page=2", "https://***@h/x?token=***&page=2"),
        ("s3://b/k?X-Amz-Signature=dead&X-Amz-Date=1", "s3://b/k?X-Amz-Signature=***&X-Amz-Date=1"),
        ("https://h/x?api_key=1&sig=2&access_token=3", "https://h/x?api_key=***&sig=***&access_token=***"),
        ("https://h/x?max_tokens=5&tokenizer=t", "https://h/x?max_tokens=5&tokenizer=t"),
        ("sqlite:////tmp/a@b/mlflow.db", "sqlite:////tmp/a@b/mlflow.db"),
    ],
)
def test_query_string_credentials_are_redacted(url, expected):
    assert redact_url(url) == expected


def vllm_run(tmp_path: Path, **vllm) -> RunConfig:
    return RunConfig.model_validate({"output_dir": str(tmp_path), "inference": {"backend": "vllm", "vllm": vllm}})


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ({"vllm": {"env": {"HF_TOKEN": PLANTED}}}, r'inference.vllm.env.HF_TOKEN holds a secret .* "\$\{HF_TOKEN\}"'),
        ({"vllm": {"env": {"PROXY": f"http://u:{PLANTED}@p"}}}, "inference.vllm.env.PROXY holds a secret"),
        ({"vllm": {"env": {"BAD KEY": "1"}}}, "inference.vllm.env.BAD KEY: not an environment variable name"),
        ({"vllm": {"env": {"A": "x${B}"}}}, "a reference is the whole value"),
        ({"vllm_extra": {"hf_token": PLANTED}}, "inference.vllm_extra.hf_token: a secret as a flag"),
        ({"vllm_extra": {"api_key": PLANTED}}, "inference.vllm_extra.api_key is set by rollflow"),
        (
            {"deployment": {"type": "disaggregated", "decode_env_overrides": {"WANDB_API_KEY": PLANTED}}},
            "inference.deployment.decode_env_overrides.WANDB_API_KEY holds a secret",
        ),
    ],
)
def test_secrets_written_inline_are_refused_at_load(keys, said):
    with pytest.raises(ValidationError, match=said) as err:
        RunConfig.model_validate({"inference": {"backend": "vllm", **keys}})
    # what the loader prints of a model-level refusal (config/loader.py `_describe`) names the key, not the value
    assert PLANTED not in " ".join(e["msg"] for e in err.value.errors())


def test_ordinary_variables_and_references_load():
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_TOKEN": "${HF_TOKEN}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert vllm_run(Path("/tmp"), env=env).inference.vllm.env == env


def test_a_planted_secret_reaches_the_vllm_process_and_no_file_param_or_command(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from runtime.tracking import start_mlflow_run

    monkeypatch.setenv("ROLLFLOW_TEST_SOURCE", PLANTED)
    cfg = vllm_run(tmp_path / "run", env={"HF_TOKEN": "${ROLLFLOW_TEST_SOURCE}"})
    cfg.tracking.tracking_uri = f"https://alice:{PLANTED}@mlflow.example/x?token={PLANTED}"
    tracking = cfg.tracking.tracking_uri
    write_configs(cfg, "rid", "http://127.0.0.1:1", tracking, "m", plan=launch_plan(cfg))
    assert (tmp_path / "run" / "config" / "vllm-commands.sh").exists()
    assert files_holding(tmp_path / "run", PLANTED) == []
    run_id = start_mlflow_run(f"sqlite:///{tmp_path}/mlflow.db", "e", "r", public_config(cfg), {})
    params = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id).data.params
    assert params["inference.vllm.env.HF_TOKEN"] == "${ROLLFLOW_TEST_SOURCE}"
    assert not [k for k, v in params.items() if PLANTED in v]
    # the local launch: the process gets the value, its logged command line the reference
    (rep,) = vllm_launch.render(cfg.inference, nodes=["127.0.0.1"], python="/v/bin/python")
    (server,) = rep.processes
    token = processes.new_token()
    env = processes.process_env(server, token)
    assert env["HF_TOKEN"] == PLANTED and env[vllm_launch.TOKEN_ENV] == token
    assert PLANTED not in server.shell() and token not in server.shell() and token not in server.argv
    monkeypatch.delenv("ROLLFLOW_TEST_SOURCE")
    with pytest.raises(SystemExit, match="HF_TOKEN = '\\$\\{ROLLFLOW_TEST_SOURCE\\}': ROLLFLOW_TEST_SOURCE is not set"):
        processes.process_env(server, token)


def test_rendered_commands_quote_values_and_keep_references_for_the_shell():
    p = vllm_launch.Process("p", "n", ["env"], {"A": "${SRC}", "B": "v w;$(touch x)", "HF_TOKEN": PLANTED})
    line = p.shell()
    assert PLANTED not in line
    out = subprocess.run(["bash", "-c", line], env={"SRC": "from-env"}, capture_output=True, text=True, check=True)
    assert {"A=from-env", "B=v w;$(touch x)", "HF_TOKEN=***"} <= set(out.stdout.splitlines())
    with pytest.raises(vllm_launch.RenderError, match="not a variable name"):
        vllm_launch.Process("p", "n", ["env"], {"A;rm -rf /": "1"}).shell()
    assert redact_env({"X": "${Y}", "AWS_SECRET_ACCESS_KEY": "k", "U": "http://u:p@h"}) == {
        "X": "${Y}",
        "AWS_SECRET_ACCESS_KEY": "***",
        "U": "http://***@h",
    }


def test_the_dry_runs_batch_script_holds_no_tracking_credentials(tmp_path):
    from rollflow.cli import main

    uri = f"https://alice:{PLANTED}@mlflow.example/x"
    assert main(["rl", "@", str(TINY), "--output-dir", str(tmp_path), "--tracking.tracking_uri", uri, "--dry-run"]) == 0
    assert (tmp_path / "config" / "slurm.sbatch").exists()
    assert files_holding(tmp_path, PLANTED) == []


def test_a_flow_refuses_tracking_credentials_in_its_parameters_before_writing_anything(tmp_path, monkeypatch):
    """A Prefect deployment's parameters are stored and shown, and a resume reads run.json, where the URI is
    redacted: such a run could not resume. The CLI moves the URI to MLFLOW_TRACKING_URI before the flow."""
    from runtime.lifecycle import start_new_run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # main's behaviour: tries to reach the store
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path)})
    cfg.tracking.tracking_uri = f"http://alice:{PLANTED}@127.0.0.1:9/"
    with pytest.raises(ValueError, match="carries credentials in the flow's parameters: set MLFLOW_TRACKING_URI"):
        start_new_run(cfg, overwrite=False)
    assert not (tmp_path / "config").exists() and files_holding(tmp_path, PLANTED) == []


def test_inside_a_slurm_job_inference_serves_on_its_node_and_vllm_stays_on_loopback(tmp_path, monkeypatch):
    """tasks/resume.py: on another node than the orchestrator's, the engine binds (engines/inference/server.py binds
    inference.host) and is reached at that node's name; the vLLM servers behind it stay on 127.0.0.1."""
    import tasks.resume

    monkeypatch.setattr(tasks.resume, "get_run_logger", lambda: logging.getLogger("test"))
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "inference": {"backend": "vllm"}})

    def placed(node: str | None) -> tuple[dict, dict, str]:
        tasks.resume.prepare_attempt.fn(cfg, "rid", None, None, inference_node=node)
        read = lambda name: json.loads((tmp_path / "config" / name).read_text())  # noqa: E731
        return read("inference.json"), read("orchestrator.json"), read("vllm-plan.json")

    inference, orchestrator, plan = placed("node-b")
    port = inference["inference"]["port"]
    assert inference["inference"]["host"] == "node-b"
    assert orchestrator["inference_url"] == f"http://node-b:{port}"
    (server,) = plan["replicas"][0]["processes"]
    assert server["argv"][server["argv"].index("--host") + 1] == "127.0.0.1"
    tasks.resume.prepare_attempt.fn(cfg, "rid", None, None, inference_node=None)  # beside the orchestrator
    assert json.loads((tmp_path / "config" / "inference.json").read_text())["inference"]["host"] == "127.0.0.1"


def test_the_vllm_middleware_guards_every_route_but_health_and_fails_closed(monkeypatch):
    """rollflow_vllm_auth.RequireToken (what vLLM loads with --middleware) around a plain ASGI app; the
    integration test (tests/integration/test_vllm_backend.py) checks it inside a real vLLM server."""
    import asyncio
    import sys

    import httpx

    monkeypatch.syspath_prepend(str(processes.WORKER_DIR))
    sys.modules.pop("rollflow_vllm_auth", None)
    import rollflow_vllm_auth

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    monkeypatch.delenv(vllm_launch.TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match="ROLLFLOW_VLLM_TOKEN must hold"):
        rollflow_vllm_auth.RequireToken(app)
    token = processes.new_token()
    monkeypatch.setenv(vllm_launch.TOKEN_ENV, token)
    guarded = rollflow_vllm_auth.RequireToken(app)

    async def statuses() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://v") as c:
            calls = [c.get("/health"), c.post("/pause"), c.post("/collective_rpc"), c.get("/v1/models")]
            calls += [c.post("/pause", headers={"Authorization": "Bearer " + token[:-1]})]
            calls += [c.post("/pause", headers={"Authorization": "Bearer " + token})]
            return [(await call).status_code for call in calls]

    assert asyncio.run(statuses()) == [200, 401, 401, 401, 401, 200]
