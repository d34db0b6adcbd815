"""`rollflow sft` end to end: the real CLI and Prefect flow fine-tune the built-in tiny model on a JSONL of
chats and publish a model that answers them; a run SIGKILLed (its trainer, then its whole process tree)
resumes to the same losses and weights as an uninterrupted one; a dataset read from S3 (moto on loopback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, cli_argv, cli_env, descendants, processes_mentioning, start_cli
from safetensors.torch import load_file

from config.model import ModelConfig
from config.sft import FileData
from engines.models import modeldir
from engines.models.tokenizer import CharTokenizer, render_conversation
from engines.trainer.sft_data import load_files
from engines.trainer.sft_files import DataError

pytestmark = pytest.mark.slow
PAIRS = [
    ("hello", "hi there"), ("color of sky", "blue"), ("two plus two", "four"), ("capital of france", "paris"),
    ("say yes", "yes"), ("opposite of up", "down"), ("first letter", "a"), ("count to three", "1 2 3"),
]  # fmt: skip
SYSTEM = {"role": "system", "content": "be brief. "}
MULTI = [
    {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "again"}, {"role": "assistant", "content": "yo yo"},
]  # fmt: skip


def _dataset(tmp_path: Path) -> Path:
    """Eight single-turn chats with a system prompt and one two-turn chat, as JSON Lines."""
    rows = [[SYSTEM, {"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in PAIRS]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [*rows, MULTI]))
    return path


def _profile(tmp_path: Path, steps: int, interval: int) -> Path:
    path = tmp_path / "sft.toml"
    path.write_text(
        f'[sft]\nsteps = {steps}\nbatch_size = 8\nlr = 3e-3\npacking = true\n[sft.data]\npath = "chat.jsonl"\n'
        f"[checkpoint]\ninterval = {interval}\n[tracking]\nmlflow = false\n"
        "[restart]\nmax_restarts = 2\nbackoff_s = 0.2\nlease_ttl_s = 5.0\n"
    )
    return path


def _sft_args(tmp_path: Path, out: Path, steps: int, interval: int) -> list[str]:
    return ["sft", "@", str(TINY), "@", str(_profile(tmp_path, steps, interval)), "--output-dir", str(out)]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _greedy(model, tok, prompt: list[int], limit: int = 16) -> str:
    out: list[int] = []
    with torch.no_grad():
        while len(out) < limit:
            nxt = int(model(torch.tensor([prompt + out]))[0, -1].argmax())
            if nxt == tok.eos_id:
                break
            out.append(nxt)
    return tok.decode(out)


def test_sft_on_a_jsonl_dataset_publishes_a_model_that_answers_it(tmp_path, prefect_api):
    _dataset(tmp_path)
    out = tmp_path / "run"
    proc = subprocess.run(
        cli_argv(*_sft_args(tmp_path, out, 60, 30)),
        cwd=tmp_path, env=cli_env(prefect_api), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    # measured: 3.24 over the first 5 steps, 0.17 over the last 5 (the untrained model: ln 49 = 3.9 per token)
    assert summary["steps"] == 60 and summary["loss_last5"] < 0.35 < 3.0 < summary["loss_first5"]
    assert summary["data_samples"] == 9 and summary["skipped_rows"] == {}
    assert summary["final_weights"] == f"{out}/weights/step=000060" and len(summary["loss_curve"]) == 20
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["step=000030", "step=000060"]
    # the publication is a model directory: `[model] path` loads it (an RL run starts from it the same way)
    loaded = modeldir.load(ModelConfig(path=summary["final_weights"], max_seq_len=64), pretrained=True)
    tok, model = loaded.tokenizer, loaded.model.eval()
    answers = [_greedy(model, tok, tok.render_messages([SYSTEM, {"role": "user", "content": q}])) for q, _ in PAIRS]
    print(f"greedy answers: {answers}")
    assert sum(got == want for got, (_, want) in zip(answers, PAIRS, strict=True)) >= 7  # measured: 8 of 8
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # the session's API: pick this run's flow run
        (run,) = [r for r in client.read_flow_runs() if r.parameters.get("config", {}).get("output_dir") == str(out)]
        artifacts = [a for a in client.read_artifacts() if a.flow_run_id == run.id]
    assert any(a.key == "sft-run-summary" and "| 60 |" in str(a.data) for a in artifacts)


def _wait(cli, out: Path, step: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (out / "metrics.jsonl").exists() or len(_losses(out)) < step:
        assert cli.poll() is None and time.monotonic() < deadline, f"no sft step {step}"
        time.sleep(0.05)


def _trainer_pid(cli_pid: int) -> int | None:
    for pid in descendants(cli_pid):
        try:
            if "config/sft.json" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return pid
        except OSError:
            continue
    return None


@pytest.mark.long
def test_a_sigkilled_sft_run_resumes_to_the_same_losses_and_weights(tmp_path, prefect_api):
    """Kill the trainer mid-run (the flow restarts it from its checkpoint), then the whole process tree (resume
    with --resume): every loss and the final weights equal an uninterrupted run's, bit for bit."""
    _dataset(tmp_path)
    steps, interval = 50, 10
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    proc = subprocess.run(
        cli_argv(*_sft_args(tmp_path, whole, steps, interval)), cwd=tmp_path, env=cli_env(prefect_api), timeout=300
    )
    assert proc.returncode == 0
    log = tmp_path / "cut.log"
    cli = start_cli(tmp_path, log, prefect_api, *_sft_args(tmp_path, cut, steps, interval))
    _wait(cli, cut, 15)
    trainer = _trainer_pid(cli.pid)
    assert trainer is not None
    os.kill(trainer, signal.SIGKILL)  # after checkpoint 10: steps 11.. are trained again
    _wait(cli, cut, 35)
    for pid in [cli.pid, *descendants(cli.pid)]:
        os.kill(pid, signal.SIGKILL)
    cli.wait()
    deadline = time.monotonic() + 30
    while processes_mentioning(str(cut)) and time.monotonic() < deadline:
        time.sleep(0.2)
    resumed = start_cli(tmp_path, log, prefect_api, *_sft_args(tmp_path, cut, steps, interval), "--resume")
    assert resumed.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "restart 1/2 from the last checkpoint" in text and text.count("starting from checkpoint step=") >= 2
    assert _losses(cut) == _losses(whole) and len(_losses(whole)) == steps
    final = f"weights/step={steps:06d}/model.safetensors"
    a, b = load_file(str(whole / final)), load_file(str(cut / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_dataset_is_read_from_s3(monkeypatch):
    from config.storage import StorageConfig
    from storage.fs import Storage
    from tests.s3util import BUCKET, CREDENTIALS, moto_s3

    tok = CharTokenizer()
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    bad = [{"role": "narrator", "content": "x"}, *MULTI]
    with moto_s3() as endpoint:
        fs, path = Storage(StorageConfig(endpoint_url=endpoint)).open(f"s3://{BUCKET}/chats/")
        fs.pipe_file(f"{path}/part-0.jsonl", json.dumps({"messages": MULTI}).encode() + b"\n")
        fs.pipe_file(f"{path}/part-1.jsonl", json.dumps({"messages": bad}).encode())
        data = load_files(FileData(path=path, on_bad_row="skip"), tok, 64, fs)
        assert [s.ids for s in data.samples] == [render_conversation(tok, MULTI)[0]]
        assert data.report["skipped"] == {"unknown_role": 1}
        with pytest.raises(DataError, match=rf"s3://{BUCKET}/chats/part-1.jsonl: row 1: message 0 has role"):
            load_files(FileData(path=path), tok, 64, fs)
