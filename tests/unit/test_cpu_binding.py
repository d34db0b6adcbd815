"""CPU binding of a local run's components (config/cpus.py, engines/entry.py, the vLLM servers' shares)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from config.cpus import CPUS_ENV, CpuBindingConfig, format_cpu_list, parse_cpu_list, plan, split
from config.loader import load_run_config
from engines.inference.vllm.processes import OMP_BIND_ENV, core_shares
from launch.vllm import Process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_lists_round_trip() -> None:
    assert parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert format_cpu_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert format_cpu_list([3]) == "3"


@pytest.mark.parametrize("text", ["", "a", "0-", "1,,2", "0 1", "3-1", "0;rm -rf /"])
def test_bad_cpu_lists_are_refused_with_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list|backwards"):
        parse_cpu_list(text)


def test_split_is_contiguous_and_even() -> None:
    assert split([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split([4, 5], 2) == [[4], [5]]
    assert split([0], 3) == [[0], [0], [0]]  # fewer cores than servers: they share, none gets nothing


def test_auto_gives_inference_and_trainer_disjoint_cores() -> None:
    auto = CpuBindingConfig(mode="auto")
    two = plan(auto, {0, 1}, 1, 1)
    assert two.cpus == {"inference": "0", "trainer": "1"}  # the orchestrator: anywhere
    assert two.env("orchestrator") == {} and two.env("trainer") == {CPUS_ENV: "1"}
    eight = plan(auto, {0, 1, 2, 3, 4, 5, 6, 7}, 2, 4)
    assert eight.cpus == {"inference": "0-1", "trainer": "2-5", "orchestrator": "6-7", "teacher": "6-7"}


def test_auto_binds_nothing_when_the_threads_do_not_fit() -> None:
    p = plan(CpuBindingConfig(mode="auto"), {0, 1}, 2, 1)
    assert p.cpus == {} and "exceed the 2 usable core(s) 0-1" in p.reason
    assert plan(CpuBindingConfig(), {0, 1}, 1, 1).cpus == {}  # off by default


def test_manual_lists_are_checked_against_the_usable_cores() -> None:
    manual = CpuBindingConfig(mode="manual", inference="0", trainer="1", orchestrator="0-1")
    want = {"inference": "0", "trainer": "1", "orchestrator": "0-1", "teacher": "0-1"}
    assert plan(manual, {0, 1}, 1, 1).cpus == want
    with pytest.raises(ValueError, match=r"deployment.cpus.trainer='1': core\(s\) 1 are not usable here"):
        plan(CpuBindingConfig(mode="manual", inference="0", trainer="1"), {0}, 1, 1)


def test_config_refuses_lists_without_manual_and_manual_without_lists() -> None:
    with pytest.raises(ValidationError, match="CPU lists are read only with mode = 'manual'"):
        CpuBindingConfig(mode="auto", trainer="1")
    with pytest.raises(ValidationError, match="needs deployment.cpus.inference and .trainer"):
        CpuBindingConfig(mode="manual", inference="0")
    with pytest.raises(ValidationError, match="is not a CPU list"):
        CpuBindingConfig(mode="manual", inference="0", trainer="x")


def test_run_config_counts_threads_per_rank_and_replica() -> None:
    cfg = load_run_config(
        [os.path.join(ROOT, "profiles/tiny-cpu.toml")],
        [("deployment.cpus.mode", "auto"), ("trainer.num_threads", "2"), ("inference.num_threads", "1")],
    )
    assert cfg.cpu_plan({0, 1, 2, 3}).cpus["trainer"] == "1-2"
    assert cfg.cpu_plan({0, 1}).cpus == {}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_a_component_binds_itself_to_its_cores() -> None:
    """The real entry path in a real process: it runs on the core it was given, and so do its threads."""
    core = max(os.sched_getaffinity(0))
    code = (
        "import os, threading; from engines.entry import bind_cpus; bind_cpus(); out = []; "
        "t = threading.Thread(target=lambda: out.append(os.sched_getaffinity(0))); t.start(); t.join(); "
        "print(sorted(os.sched_getaffinity(0)), sorted(out[0]))"
    )
    env = {**os.environ, CPUS_ENV: str(core), "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{core}] [{core}]"
    env[CPUS_ENV] = "4096"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and f"{CPUS_ENV}='4096': cannot bind this process" in bad.stderr


def test_vllm_servers_split_the_inference_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    server = ["python", "-m", "vllm.entrypoints.openai.api_server"]
    procs = [
        Process("vllm-r0", "127.0.0.1", server, {}, "http://127.0.0.1:1"),
        Process("vllm-r1", "127.0.0.1", server, {}, "http://127.0.0.1:2"),
        Process("router-r0", "127.0.0.1", ["vllm-router"], {}, "http://127.0.0.1:3"),
        Process("vllm-r2", "127.0.0.1", server, {OMP_BIND_ENV: "7"}, "http://127.0.0.1:4"),  # its own: kept
    ]
    monkeypatch.delenv(CPUS_ENV, raising=False)
    assert core_shares(procs) == {}
    monkeypatch.setenv(CPUS_ENV, "0-3")
    assert core_shares(procs) == {"vllm-r0": {OMP_BIND_ENV: "0-1"}, "vllm-r1": {OMP_BIND_ENV: "2-3"}}
