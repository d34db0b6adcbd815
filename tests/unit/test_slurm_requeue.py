"""A requeued Slurm job (preempted, or `scontrol requeue`) reruns its batch script with SLURM_RESTART_COUNT >= 1:
the `rl` flow then resumes the run it opened in its output directory (runtime/lifecycle.py
`continues_requeued_job`) rather than refusing the directory; a first run, or a job preempted before it opened
its run, starts as new. The end-to-end preemption is tests/integration/test_slurm_faults.py."""

from __future__ import annotations

import logging

import pytest

from config.run import RunConfig
from runtime.lifecycle import continues_requeued_job, start_new_run
from runtime.slurm import requeued

LOG = logging.getLogger("test")


@pytest.mark.parametrize(
    ("count", "expected"), [(None, False), ("0", False), ("1", True), ("3", True), ("", False), ("x", False)]
)
def test_requeued_reads_slurm_restart_count(count, expected):
    assert requeued({} if count is None else {"SLURM_RESTART_COUNT": count}) is expected


def test_a_requeued_job_resumes_its_opened_run_and_starts_an_unopened_one(tmp_path, monkeypatch):
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path / "run"), "tracking": {"mlflow": False}})
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert not continues_requeued_job(cfg, LOG)  # preempted before the run was opened: a new run
    start_new_run(cfg, overwrite=False)
    assert continues_requeued_job(cfg, LOG)
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert not continues_requeued_job(cfg, LOG)  # a first job: the directory is refused as before
