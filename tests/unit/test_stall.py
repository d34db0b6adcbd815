"""Stall detection: the watch's rules on a clock of the test's, the heartbeat line through a shared pipe, the
config keys, and real processes under `supervise` — a SIGSTOPped one and one whose loop stops moving are
stopped as ComponentStalled within their timeout; one that keeps moving is left alone."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from config.loader import ConfigError, load_run_config
from config.stall import HEARTBEAT_ENV, IDLE, Beat, StallConfig, format_beat, split_beat
from engines.heartbeat import Heartbeat
from runtime.process import ComponentStalled, supervise
from runtime.stall import StallWatch
from storage.runstate import pid_alive

FLOORS = {"trainer_s": 10.0, "orchestrator_s": 10.0, "inference_s": 10.0, "startup_s": 30.0, "pace_factor": 2.0}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch() -> tuple[StallWatch, Clock]:
    clock = Clock()
    return StallWatch(StallConfig(**FLOORS), clock), clock


def _run(watch: StallWatch, clock: Clock, seconds: float, beats: dict[str, Beat]) -> None:
    """`seconds` of heartbeats, one a second, each component at its (fixed) state."""
    for _ in range(int(seconds)):
        clock.now += 1
        for name, beat in beats.items():
            watch.beat(name, beat)


def test_a_working_component_is_stuck_after_its_floor_and_names_what_it_did():
    watch, clock = _watch()
    watch.launched("trainer")
    watch.beat("trainer", Beat(1, "", 0, "training step 3"))
    watch.beat("trainer", Beat(2, "", 0, "training step 3"))  # moved: its floor applies from now on
    _run(watch, clock, 10, {"trainer": Beat(2, "", 0, "training step 3")})
    assert watch.verdict("trainer") is None
    _run(watch, clock, 1, {"trainer": Beat(2, "", 0, "training step 3")})
    why = watch.verdict("trainer")
    assert why is not None and "trainer is stuck: no progress for 11s (timeout 10s)" in why
    assert "progress 2 (training step 3)" in why


def test_the_timeout_follows_the_slowest_stretch_of_work():
    watch, clock = _watch()
    watch.launched("trainer")
    watch.beat("trainer", Beat(0, ""))
    clock.now += 1
    watch.beat("trainer", Beat(1, ""))  # the first move ends the loading stretch: not pace
    _run(watch, clock, 8, {"trainer": Beat(1, "")})
    watch.beat("trainer", Beat(2, ""))  # an 8 s stretch of work
    assert watch.timeout_s("trainer") == 16.0  # pace_factor 2 x 8 s over the 10 s floor
    _run(watch, clock, 15, {"trainer": Beat(2, "")})
    assert watch.verdict("trainer") is None
    _run(watch, clock, 2, {"trainer": Beat(2, "")})
    assert "no progress for 17s (timeout 16s)" in (watch.verdict("trainer") or "")


def test_a_waiting_component_is_judged_by_the_one_it_waits_on():
    watch, clock = _watch()
    for name in ("trainer", "orchestrator", "inference"):
        watch.launched(name)
    waiting = {"trainer": Beat(5, "orchestrator"), "orchestrator": Beat(9, "inference"), "inference": Beat(3, IDLE)}
    _run(watch, clock, 1, waiting)
    # the inference server moves (answers requests): nobody is stuck however long the others wait
    for k in range(40):
        _run(watch, clock, 1, {**waiting, "inference": Beat(4 + k, "")})
    assert [watch.verdict(n) for n in ("trainer", "orchestrator", "inference")] == [None, None, None]
    # it stops moving while it holds work: it is the one stuck; the others are not blamed before it
    _run(watch, clock, 11, {**waiting, "inference": Beat(43, "")})
    assert watch.verdict("trainer") is None and watch.verdict("orchestrator") is None
    assert "inference is stuck: no progress" in (watch.verdict("inference") or "")


def test_an_idle_server_is_never_stuck_but_a_wait_on_it_is_bounded():
    watch, clock = _watch()
    for name in ("orchestrator", "inference"):
        watch.launched(name)
        watch.beat(name, Beat(0, ""))
        watch.beat(name, Beat(1, ""))
    beats = {"orchestrator": Beat(1, "inference", 0, "generating step 2"), "inference": Beat(1, IDLE)}
    _run(watch, clock, 40, {"inference": Beat(1, IDLE)})
    assert watch.verdict("inference") is None
    _run(watch, clock, 11, beats)  # waits on a server that holds nothing: its request is lost
    why = watch.verdict("orchestrator") or ""
    assert "waiting on orchestrator -> inference (idle), none of which moved" in why


def test_a_silent_server_is_blamed_not_the_one_waiting_on_it():
    watch, clock = _watch()
    for name in ("orchestrator", "inference"):
        watch.launched(name)
        watch.beat(name, Beat(0, ""))
        watch.beat(name, Beat(1, ""))
    clock.now += 1
    watch.beat("inference", Beat(1, IDLE))  # its last heartbeat, then SIGSTOP: it accepts and never answers
    _run(watch, clock, 12, {"orchestrator": Beat(1, "inference", 0, "generating step 2")})
    assert watch.verdict("orchestrator") is None
    assert "inference is stuck: no heartbeat for 12s" in (watch.verdict("inference") or "")


def test_two_components_waiting_on_each_other_are_stuck():
    watch, clock = _watch()
    for name in ("trainer", "orchestrator"):
        watch.launched(name)
        watch.beat(name, Beat(0, ""))
        watch.beat(name, Beat(1, ""))
    _run(watch, clock, 11, {"trainer": Beat(1, "orchestrator"), "orchestrator": Beat(1, "trainer")})
    assert "trainer -> orchestrator -> trainer (a circle)" in (watch.verdict("trainer") or "")


def test_silence_is_stuck_after_startup_then_after_the_floor():
    watch, clock = _watch()
    watch.launched("inference")
    clock.now += 29
    assert watch.verdict("inference") is None
    clock.now += 2
    assert "no heartbeat since it started (timeout 30s)" in (watch.verdict("inference") or "")
    watch.launched("inference")  # a restart forgets the old process
    watch.beat("inference", Beat(0, IDLE))
    watch.beat("inference", Beat(1, IDLE))
    clock.now += 11
    assert "no heartbeat for 11s (timeout 10s): the process is stopped" in (watch.verdict("inference") or "")


def test_each_rank_is_judged_and_labelled():
    watch, clock = _watch()
    watch.launched("trainer")
    for rank in (0, 1):
        watch.beat("trainer", Beat(0, "", rank))
        watch.beat("trainer", Beat(1, "", rank))
    _run(watch, clock, 11, {})
    why = watch.verdict("trainer") or ""
    assert why.startswith("trainer rank 0 is stuck: no heartbeat") and "trainer rank 1:" in why


def test_a_disabled_watch_says_nothing():
    watch = StallWatch(StallConfig(enabled=False, startup_s=1), Clock())
    watch.launched("trainer")
    watch.clock.now += 100  # type: ignore[attr-defined]
    assert watch.verdict("trainer") is None


def test_a_weight_push_in_flight_outranks_the_wait_for_its_version():
    """The orchestrator waits for a policy version (on the trainer); once its push of that version to the engine
    is in flight, whichever began first, it waits on the engine."""
    beat = Heartbeat(None)
    with beat.waiting_on("trainer"), beat.waiting_on("inference", priority=1):
        assert beat.beat().waiting == "inference"
    with beat.waiting_on("inference", priority=1), beat.waiting_on("trainer"):
        assert beat.beat().waiting == "inference"
    with beat.waiting_on("orchestrator"):
        assert beat.beat().waiting == "orchestrator"
    assert beat.beat().waiting == ""
    beat.server = True
    with beat.hold():
        assert beat.beat().waiting == "" and beat.beat().doing == "1 held"
    assert beat.beat().waiting == IDLE and beat.progress == 1  # finishing held work is progress


def test_a_heartbeat_survives_a_partial_line_before_it():
    beat = Beat(12, "orchestrator", 1, "waiting for rollouts step=3")
    line = "step 7 is half-writ" + format_beat(beat).decode().rstrip("\n")
    assert split_beat(line) == ("step 7 is half-writ", beat)
    assert split_beat("an ordinary line") == ("an ordinary line", None)
    assert split_beat("\x1erollflow-heartbeat {broken") == ("\x1erollflow-heartbeat {broken", None)


def test_stall_keys_are_validated(tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text("[restart.stall]\ntrainer_s = 0\n")
    with pytest.raises(ConfigError) as exc:
        load_run_config([profile])
    assert "restart.stall.trainer_s" in str(exc.value)
    cfg = load_run_config([], [("restart.stall.inference_s", "42"), ("restart.stall.heartbeat_s", "0.5")])
    assert cfg.restart.stall.floor_s("teacher") == 42.0 and cfg.restart.stall.floor_s("warmup") == 600.0


# A component's main loop: advances until ./freeze appears, then hangs with its heartbeat thread still beating.
CHILD = """
import os, time
from engines.heartbeat import heartbeat
beat = heartbeat()
beat.start_thread()
print(f"ready {os.getpid()}", flush=True)
while not os.path.exists("freeze"):
    beat.advance("looping")
    time.sleep(0.05)
time.sleep(600)
"""


def _supervise(tmp_path, lines: list[str], stall: StallWatch) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []
    env = {HEARTBEAT_ENV: "0.1", "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", f"import os; os.chdir({str(tmp_path)!r}); exec({CHILD!r})"]

    def run() -> None:
        try:
            supervise("trainer", argv, env, lines.append, threading.Event(), grace_s=0.5, stall=stall)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _loop_pid(lines: list[str], stall: StallWatch, timeout_s: float = 30) -> int:
    """The child's pid once its loop has moved at least once."""
    deadline = time.monotonic() + timeout_s
    while not lines or stall.timeout_s("trainer") == stall.cfg.startup_s:
        assert time.monotonic() < deadline, f"the child never started: {lines}"
        time.sleep(0.05)
    return int(lines[0].split()[1])


@pytest.mark.parametrize("fault", ["sigstop", "frozen loop"])
def test_a_stuck_process_is_stopped_within_its_timeout(tmp_path, fault):
    """SIGSTOP: no heartbeat at all. A frozen loop: heartbeats from its thread, but its counter stays put."""
    lines: list[str] = []
    stall = StallWatch(StallConfig(trainer_s=2.0, startup_s=60, pace_factor=1))
    thread, errors = _supervise(tmp_path, lines, stall)
    pid = _loop_pid(lines, stall)
    time.sleep(2.5)  # a loop that keeps moving is never stuck (longer than its timeout)
    assert thread.is_alive() and not errors
    faulted = time.monotonic()
    if fault == "sigstop":
        os.kill(pid, signal.SIGSTOP)
    else:
        (tmp_path / "freeze").touch()
    thread.join(timeout=30)
    detected = time.monotonic() - faulted
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], ComponentStalled), errors
    expected = "no heartbeat for" if fault == "sigstop" else "no progress for"
    assert f"trainer is stuck: {expected}" in str(errors[0]) and "progress" in str(errors[0])
    # timeout 2 s (from the last beat, up to 0.1 s before the fault) + one 0.5 s check + the stop (SIGTERM and
    # SIGCONT, SIGKILL after 0.5 s), and 2 s for a loaded machine
    assert 1.8 <= detected < 2.0 + 0.5 + 0.5 + 2.0, detected
    assert not pid_alive(pid)
    assert not any("rollflow-heartbeat" in line for line in lines), "heartbeats leaked into the log"
