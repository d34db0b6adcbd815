"""A run directory written by someone else: what rollflow reads back from it never runs code, reads or writes
outside it, or trusts a shared temp folder. Real files, real DCP save/load, the real resume CLI path."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from config.loader import ConfigError, stored_with_sources
from config.run import RunConfig
from engines.inference.vllm import processes
from engines.trainer import checkpoint
from rollflow.cli import main
from runtime.rundir import write_run_config
from storage import runstate, weights
from storage.fs import MANIFEST, MANIFEST_CHECKSUM, CorruptError, get_fs, read_manifest, read_verified
from tests.unit.test_checkpoint_formats import Tiny


def _recommit(directory: Path, files: dict[str, bytes]) -> None:
    """Add or replace manifest entries the way anyone who can write the directory can: sizes, sha256s and the
    manifest's own checksum all consistent."""
    m = json.loads((directory / MANIFEST).read_text())
    for name, data in files.items():
        m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body = {k: v for k, v in m.items() if k != MANIFEST_CHECKSUM}
    m[MANIFEST_CHECKSUM] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (directory / MANIFEST).write_text(json.dumps(m))


def _publication(tmp_path: Path) -> tuple[object, str, Path]:
    fs, root = get_fs(str(tmp_path / "run"))
    directory = Path(weights.publish(fs, root, 1, {"w": torch.arange(4.0)}, files={"config.json": b"{}"}))
    return fs, root, directory


def test_manifest_names_that_leave_the_directory_are_refused(tmp_path):
    fs, root, pub = _publication(tmp_path)
    evil = b"planted"
    # `../../evil` is read from the run directory and would be written next to the cache; an absolute name would be
    # written where it names
    (Path(root) / "evil").write_bytes(evil)
    absolute = tmp_path / "abs-evil"
    inside = pub / str(absolute).lstrip("/")
    inside.parent.mkdir(parents=True)
    inside.write_bytes(evil)
    _recommit(pub, {"../../evil": evil, str(absolute): evil})
    cache = tmp_path / "cache" / "run"
    cache.mkdir(parents=True)
    with pytest.raises(CorruptError, match="not a relative path"):
        processes.materialize(fs, root, 1, cache)
    assert not (tmp_path / "cache" / "evil").exists() and not absolute.exists()
    with pytest.raises(CorruptError):
        weights.export_hf(fs, str(pub), str(tmp_path / "export" / "hf"))
    assert not (tmp_path / "export" / "evil").exists()
    with pytest.raises(CorruptError, match=r"'\.\./\.\./evil'.*not a relative path") as err:
        read_manifest(fs, str(pub))
    assert f"{pub}/{MANIFEST}" in str(err.value)


def test_a_listed_symlink_out_of_the_directory_is_not_followed(tmp_path):
    fs, _, pub = _publication(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"someone else's file")
    (pub / "notes.txt").symlink_to(secret)
    _recommit(pub, {"notes.txt": secret.read_bytes()})
    with pytest.raises(CorruptError, match="outside"):
        read_verified(fs, str(pub), "notes.txt", read_manifest(fs, str(pub)))


class _Marker:
    """Unpickling it runs a shell command that creates `path` (what a hostile pickle would do)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _trained(seed: int) -> tuple[Tiny, torch.optim.AdamW, checkpoint.TrainerState]:
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1 + seed)
    model.w(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt, checkpoint.TrainerState(model, {"optimizer": opt, "rng": checkpoint.RNGState()}, None, 0)


def test_optimizer_checkpoint_pickles_never_run_and_a_genuine_one_resumes_exactly(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fs, root = get_fs(str(tmp_path / "run"))
    model, opt, state = _trained(0)
    checkpoint.save(fs, root, 1, state)
    fresh, fresh_opt, fresh_state = _trained(1)
    checkpoint.restore(fs, root, 1, fresh_state)
    got, want = fresh_opt.state_dict(), opt.state_dict()
    assert got["param_groups"] == want["param_groups"] and got["param_groups"][0]["lr"] == 0.1
    assert all(torch.equal(got["state"][i][k], v) for i, s in want["state"].items() for k, v in s.items())
    optim = tmp_path / "run" / "checkpoints" / "step=000001" / "trainer"
    marker = tmp_path / "marker"

    hostile = pickle.dumps(_Marker(marker))  # `.metadata` itself
    (optim / "optimizer" / ".metadata").write_bytes(hostile)
    _recommit(optim, {"optimizer/.metadata": hostile})
    with pytest.raises(CorruptError, match=r"optimizer/\.metadata: refusing to unpickle posix\.system"):
        checkpoint.restore(fs, root, 1, _trained(1)[2])
    assert not marker.exists()

    # a non-tensor value (DCP keeps param_groups as torch.save pickles) that would run code when loaded
    sd = get_optimizer_state_dict(model, opt)
    sd["param_groups"][0]["lr"] = _Marker(marker)
    dcp.save({"optimizer": sd}, storage_writer=dcp.FileSystemWriter(str(optim / "optimizer")), no_dist=True)
    _recommit(optim, {f"optimizer/{p.name}": p.read_bytes() for p in (optim / "optimizer").iterdir()})
    with pytest.raises(CorruptError, match=r"optimizer.param_groups.0.lr. is not plain data.*posix.system"):
        checkpoint.restore(fs, root, 1, _trained(1)[2])
    assert not marker.exists()


def _stored_run(tmp_path: Path, name: str, **changes) -> RunConfig:
    cfg = RunConfig(output_dir=str(tmp_path / name), **changes)
    fs, root = get_fs(cfg.output_dir)
    write_run_config(cfg, "rid")
    runstate.write_state(fs, root, runstate.RunState(run_id="rid", mlflow_run_id=None))
    return cfg


def test_a_stored_config_naming_code_is_refused_on_resume(tmp_path, capsys):
    marker = tmp_path / "marker"
    env = {"id": "os:system", "name": "x", "args": {"command": f"touch {marker}"}}
    cfg = _stored_run(tmp_path / "runs", "a", envs=[env])
    assert main(["resume", cfg.output_dir]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert "envs.0.id = 'os:system'" in err and "--trust-run-config" in err
    from flows.resume import resume_unfinished, stored_run

    with pytest.raises(ConfigError, match=r"envs\.0\.id = 'os:system'"):
        stored_run(cfg.output_dir)
    from prefect.logging import disable_run_logger

    with disable_run_logger():  # the scheduled flow skips it (and would go on to the next run)
        assert resume_unfinished.fn(str(tmp_path / "runs")) == []
    assert not marker.exists()


def test_settings_that_run_what_they_name_need_trust_or_the_command_line(tmp_path):
    cfg = _stored_run(tmp_path, "b", inference={"vllm": {"python": "/tmp/not-vllm"}})
    stored = json.loads((Path(cfg.output_dir) / "config" / "run.json").read_text())
    with pytest.raises(ConfigError, match=r"inference\.vllm\.python = '/tmp/not-vllm'"):
        stored_with_sources(stored, "run.json")
    stored_with_sources(stored, "run.json", [("inference.vllm.python", "/tmp/not-vllm")])  # given again
    stored_with_sources(stored, "run.json", trust=True)
    stored_with_sources(RunConfig().model_dump(mode="json"), "run.json")  # registered names only: fine


def test_a_shared_cache_folder_someone_else_made_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    top = tmp_path / f"rollflow-vllm-{os.getuid()}"
    top.mkdir(mode=0o700)
    top.chmod(0o777)  # open to every user: anyone could have planted a model in it
    (top / "rid").mkdir(mode=0o700)
    chosen = processes.cache_dir("rid")
    assert top not in chosen.parents and stat.S_IMODE(chosen.stat().st_mode) == 0o700
    top.chmod(0o700)
    if os.getuid() == 0:  # only root can make a folder another user owns
        os.chown(top, 65534, 65534)
        assert top not in processes.cache_dir("rid").parents
        os.chown(top, 0, 0)
    assert processes.cache_dir("rid") == top / "rid"


def test_a_materialized_copy_is_checked_against_the_manifest(tmp_path):
    fs, root, pub = _publication(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = cache / "step=1"
    planted.mkdir()
    (planted / "config.json").write_bytes(b"{}")
    from safetensors.torch import load_file, save_file

    save_file({"w": torch.full((4,), 7.0)}, str(planted / "model.safetensors"))
    served = processes.materialize(fs, root, 1, cache)
    assert torch.equal(load_file(str(served / "model.safetensors"))["w"], torch.arange(4.0))
    assert processes.materialize(fs, root, 1, cache) == served  # our own copy is reused
