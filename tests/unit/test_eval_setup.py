"""Evaluation setup: the `[eval]` section's checks, the load-time refusal of environments without a usable held-out
split (exit code 2, naming the env, its id and what it lacks), and the results folder's chunk commits, checksum
verification and settings check."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from config.eval import EvalConfig
from config.run import RunConfig
from engines.orchestrator.evaluation import chunks, make_spec, task_seed
from rollflow.cli import main
from storage import evals
from storage.fs import CorruptError, get_fs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"n": 4}, "greedy"),
        ({"temperature": 1.0, "n": 2, "k": [1, 4]}, "each k of pass@k must be in 1..eval.n=2"),
        ({"name": "../x"}, "one folder name"),
        ({"name": "online"}, "reserved"),
    ],
)
def test_eval_settings_are_checked(settings, message):
    with pytest.raises(ValidationError, match=message):
        EvalConfig(**settings)
    with pytest.raises(ValidationError, match="no \\[\\[envs\\]\\] entry"):
        RunConfig.model_validate({"eval": {"envs": ["nope"]}})


def test_envs_without_a_held_out_split_are_refused_at_load(tmp_path, capsys):
    profile = ROOT / "profiles" / "tiny-tools-cpu.toml"
    rc = main(["rl", "@", str(profile), "--eval.interval", "2", "--output-dir", str(tmp_path / "a"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "envs[0] (name 'tool-lookup', id 'tool-lookup') cannot be evaluated" in err
    assert "no held-out split" in err and str(profile) in err
    assert not (tmp_path / "a").exists()
    tiny = ROOT / "profiles" / "tiny-cpu.toml"
    rc = main(["rl", "@", str(tiny), "--eval.interval", "2", "--eval.num-tasks", "500", "--dry-run",
               "--output-dir", str(tmp_path / "b")])  # fmt: skip
    assert rc == 2 and "has 200 tasks, fewer than eval.num_tasks = 500" in capsys.readouterr().err


def _spec(**kw) -> dict:
    e = EvalConfig(num_tasks=5, block_tasks=2, temperature=1.0, n=2, k=[1, 2], **kw)
    return make_spec(e, ["a", "b"], 0, 8, {"model": "m"})


def _row(env: str, task: int, k: int) -> evals.EvalRow:
    return evals.EvalRow(
        env=env, task_index=task, sample_index=k, policy_version=0, policy_version_end=0, prompt_ids=[1, 2],
        completion_ids=[3], reward=0.5, correct=False, temperature=1.0, seed=task_seed(0, env, task),
        finish_reason="stop", prompt_text="p", completion_text="c", answer="a",
    )  # fmt: skip


def test_chunks_commit_verify_and_resume(tmp_path):
    spec = _spec()
    plan = chunks(spec)
    assert [(c.env, c.start, c.stop) for c in plan] == [
        ("a", 0, 2), ("a", 2, 4), ("a", 4, 5), ("b", 0, 2), ("b", 2, 4), ("b", 4, 5)
    ]  # fmt: skip
    assert task_seed(0, "a", 1) != task_seed(0, "b", 1) != task_seed(1, "b", 1)
    fs, root = get_fs(str(tmp_path))
    d = evals.eval_dir(root, "x")
    assert evals.claim(fs, d, spec) == "new"
    evals.write_chunk(fs, d, 1, [_row("a", 2, 0), _row("a", 3, 0)], {"env": "a"})
    assert evals.claim(fs, d, spec) == "resumed" and evals.committed_chunks(fs, d) == [1]
    table = evals.read_samples(fs, d)
    assert table.column("task_index").to_pylist() == [2, 3]
    with pytest.raises(evals.EvalStoreError, match="n differ"):
        evals.claim(fs, d, {**spec, "n": 3})
    shard = Path(evals.chunk_dir(d, 1)) / evals.SHARD
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CorruptError, match="checksum mismatch"):
        evals.read_samples(fs, d)
    assert evals.claim(fs, d, {**spec, "n": 3}, overwrite=True) == "new" and evals.committed_chunks(fs, d) == []
    with pytest.raises(evals.EvalStoreError, match="not one folder name"):
        evals.eval_dir(root, "../../etc")
