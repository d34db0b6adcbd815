"""Hostile values never become a line of a Slurm batch script, and shared /tmp cannot steer a run.

- every value rendered into the script is refused at load (`rollflow rl --dry-run`, which writes the
  script `rollflow submit` would submit) when it has a character outside its set, naming the key, the
  character and the allowed set; no script is written;
- the Slurm worker refuses the same values among a flow run's job variables, and a hostile flow-run name,
  before it writes a script (the configuration built as Prefect builds it from the pool's template);
- what is allowed is quoted: the rendered script, run by bash, gives the flow exactly the values it was given
  (tests/unit/golden/slurm-quoted.sbatch);
- the walltime flag is in a directory the job makes for itself, mode 0700: a file planted at the old shared
  path, or a flag that is not the job user's, does not stop the run; Slurm's USR1 still does;
- the worker writes its script without opening or following what another user planted at a predictable name.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from config.placement import SlurmJobConfig
from launch.slurm import render_sbatch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
TINY = str(ROOT / "profiles/tiny-cpu.toml")
HOSTILE = "x\necho pwned >/tmp/rollflow-pwned"


@pytest.mark.parametrize(
    ("flag", "value", "key", "allowed"),
    [
        ("--deployment.slurm.partition", HOSTILE, "deployment.slurm.partition", "letters, digits, '_'"),
        ("--deployment.slurm.account", HOSTILE, "deployment.slurm.account", "letters, digits, '_'"),
        ("--deployment.slurm.qos", HOSTILE, "deployment.slurm.qos", "letters, digits, '_'"),
        ("--deployment.slurm.mem", "4G\necho pwned", "deployment.slurm.mem", "sbatch --mem syntax"),
        ("--deployment.slurm.extra-sbatch", '["--exclusive\\necho pwned"]', "deployment.slurm.extra_sbatch", "--name"),
        ("--deployment.slurm.extra-sbatch", '["--comment=a;b"]', "deployment.slurm.extra_sbatch", "letters, digits"),
        ("--run-name", HOSTILE, "run_name", "letters, digits, '_', '.', '+'"),
        ("--output-dir", "/tmp/run\necho pwned", "output_dir", "except control characters"),
    ],
)
def test_a_hostile_value_is_refused_at_load_and_no_script_is_written(tmp_path, capsys, flag, value, key, allowed):
    from rollflow.cli import main

    out = tmp_path / "run"
    argv = ["rl", "@", TINY, "--output-dir", str(out), "--dry-run", flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{key}: " in err and allowed in err, err
    if "\n" in value and key != "deployment.slurm.mem":
        assert "'\\n'" in err, err  # the bad character is named
    assert not list(tmp_path.rglob("slurm.sbatch"))


def test_the_renderer_refuses_what_bypassed_validation() -> None:
    """A model built without validation (model_construct) still cannot break a line: the renderer checks."""
    bad = SlurmJobConfig.model_construct(**{**SlurmJobConfig().model_dump(), "partition": HOSTILE})
    with pytest.raises(ValueError, match=r"'\\n'"):
        render_sbatch(bad, 1, "j", "true", {}, "/o")
    with pytest.raises(ValueError, match=r"environment variable name 'A;touch x'"):
        render_sbatch(SlurmJobConfig(), 1, "j", "true", {"A;touch x": "1"}, "/o")


# --- the Slurm worker -------------------------------------------------------------------------------


def _job(tmp_path: Path, variables: dict, name: str = "calm-otter"):
    """The flow run's configuration as the worker gets it: the pool's base job template filled with the
    job variables (Prefect's apply_values), then prepared for the flow run."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.utilities.templating import apply_values

    from flows.slurm_worker import SlurmJobConfiguration, SlurmWorker

    template = SlurmWorker.get_default_base_job_template()
    values = SlurmJobConfiguration._get_base_config_defaults(template["variables"]["properties"])
    values.update({"working_dir": str(tmp_path), **variables})
    configuration = SlurmJobConfiguration(**apply_values(template["job_configuration"], values))
    flow_run = FlowRun(name=name, flow_id=uuid.uuid4())
    configuration.prepare_for_flow_run(flow_run)
    return configuration, flow_run


@pytest.mark.parametrize(
    ("variables", "name", "said"),
    [
        ({"partition": HOSTILE}, "calm-otter", "job variable partition: 'x\\necho"),
        ({"qos": "normal\r\n#SBATCH --uid=0"}, "calm-otter", "job variable qos:"),
        ({"mem": "4G\necho pwned"}, "calm-otter", "job variable mem: '4G\\necho pwned' is not sbatch --mem"),
        ({"extra_sbatch": ["--exclusive", "--wrap=x\necho pwned"]}, "calm-otter", "job variable extra_sbatch:"),
        ({"env": {"X=1;echo pwned;Y": "v"}}, "calm-otter", "job variable env: environment variable name"),
        ({"script_dir": "jobs\necho"}, "calm-otter", "job variable script_dir:"),
        ({}, "calm\necho pwned", "the flow run's name (it names the Slurm job): 'calm\\necho pwned'"),
    ],
)
def test_the_worker_refuses_hostile_job_variables_before_writing_a_script(tmp_path, variables, name, said) -> None:
    from flows.slurm_worker import _write_script

    configuration, flow_run = _job(tmp_path, variables, name)
    with pytest.raises(ValueError, match="allowed|sbatch --mem|name") as refused:
        _write_script(configuration, flow_run)
    assert said in str(refused.value), refused.value
    assert not list(tmp_path.rglob("*.sbatch"))


def test_the_worker_writes_its_script_without_following_a_planted_symlink(tmp_path) -> None:
    from flows.slurm_worker import _write_script

    configuration, flow_run = _job(tmp_path, {})
    jobs = tmp_path / "slurm-jobs"
    jobs.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    for name in (f"{flow_run.id}.tmp", f"{flow_run.id}.sbatch"):  # the predictable names
        (jobs / name).symlink_to(victim)
    script = _write_script(configuration, flow_run)
    assert victim.read_text() == "keep me\n"
    assert script == jobs / f"{flow_run.id}.sbatch" and not script.is_symlink()
    assert stat.S_IMODE(script.stat().st_mode) == 0o600  # it carries the Prefect API settings
    assert "python -m prefect.engine &" in script.read_text()


# --- what is allowed is quoted ---------------------------------------------------------------------------

ODD_ENV = {"ODD": 'a b\'c\n$(touch pwned)`touch pwned` "$HOME"', "EMPTY": ""}


def _quoted_job() -> str:
    slurm = SlurmJobConfig(extra_sbatch=["--constraint=h100|a100", "--nodelist=gpu[01-02]"], signal_before_s=4)
    command = f"{sys.executable} {Path(__file__).parent / 'walltime_probe.py'}"
    return render_sbatch(slurm, 1, "prefect-calm otter", command, ODD_ENV, "/scratch/my runs/slurm-%j.out")


def test_allowed_odd_values_are_quoted_in_the_script() -> None:
    text = _quoted_job().replace(sys.executable, "PYTHON").replace(str(Path(__file__).parent), "TESTS")
    path = GOLDEN / "slurm-quoted.sbatch"
    if os.environ.get("ROLLFLOW_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), "slurm-quoted.sbatch changed; rerun with ROLLFLOW_UPDATE_GOLDEN=1 if intended"


# --- the walltime flag -----------------------------------------------------------------------------------


def test_a_flag_planted_at_the_old_shared_path_does_not_stop_the_run_and_usr1_still_does(tmp_path) -> None:
    """The rendered script runs in bash as Slurm would run it (SLURM_JOB_ID set, TMPDIR shared); its flow is
    a probe (walltime_probe.py) that plants the old-path flag, watches, then sends the shell USR1."""
    script = tmp_path / "job.sbatch"
    script.write_text(_quoted_job())
    env = {**os.environ, "SLURM_JOB_ID": "4242", "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    report = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["planted_stops"] == "False", report  # the old path is any local user's to create
    assert report["dir_mode"] == "700" and report["dir_uid"] == str(os.geteuid()), report
    assert report["usr1_stops"] == "True", proc.stdout + proc.stderr
    assert report["odd"] == repr(ODD_ENV["ODD"]) and report["empty"] == "''", report
    assert not (tmp_path / "pwned").exists()
    assert not list(tmp_path.glob("rollflow-walltime.*")), "the job removes its flag directory"


def _watch(monkeypatch, flag: Path):
    from runtime.walltime import WalltimeWatch

    monkeypatch.setenv("ROLLFLOW_WALLTIME_FILE", str(flag))
    return WalltimeWatch(logging.getLogger("walltime-test"), lambda: [], poll_s=0.01)


def test_a_flag_in_a_directory_others_can_write_does_not_count(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "flagdir"
    folder.mkdir(mode=0o700)
    flag = folder / "flag"
    flag.touch()
    folder.chmod(0o1777)  # as a shared /tmp is
    with _watch(monkeypatch, flag) as watch:
        assert not watch.reached.wait(0.3)
    folder.chmod(0o700)
    with _watch(monkeypatch, flag) as watch:
        assert watch.reached.wait(5)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_flag_of_another_user_does_not_count(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "flagdir"
    folder.mkdir(mode=0o700)
    flag = folder / "flag"
    flag.touch()
    os.chown(flag, 65534, 65534)  # nobody's
    with _watch(monkeypatch, flag) as watch:
        assert not watch.reached.wait(0.3)
