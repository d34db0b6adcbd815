"""Stall detection: its settings (`[restart.stall]`) and the heartbeat line components print for the flow.

A component started by a flow with stall detection on finds the heartbeat interval in $ROLLFLOW_HEARTBEAT_S
and prints one heartbeat line on its standard output every interval (engines/heartbeat.py): its progress
counter, what it is doing (working, waiting on another component, or idle) and its rank. The flow reads the
lines out of the component's output as it drains it (runtime/process.py), keeps them out of the logs, and
judges each component against its stall timeout (runtime/stall.py). Standard output travels through
torchrun and srun unchanged, so the same line works for ranks and for components on other nodes; the flow
times every line by its own clock on arrival, so clocks of other hosts never matter.

Line: MARKER + JSON {"p": progress, "w": component waited on or "", "b": requests held (inference), "r": rank,
"s": what it is doing, in words}. Stdlib only: both the components and the flow import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import Field

from config.base import Strict

HEARTBEAT_ENV = "ROLLFLOW_HEARTBEAT_S"
MARKER = "\x1erollflow-heartbeat "  # a record separator first: no log line starts like this by chance
IDLE = "idle"  # `w` of a server with nothing in flight: it is not judged on progress


@dataclass(frozen=True)
class Beat:
    progress: int  # advances only when the component's main loop does
    waiting: str  # the component it waits on ("trainer", "orchestrator", "inference", ...), IDLE, or ""
    rank: int = 0
    doing: str = ""


def format_beat(beat: Beat) -> bytes:
    """One whole line, written with one write(2) so that ranks sharing a pipe never split it."""
    body = {"p": beat.progress, "w": beat.waiting, "r": beat.rank, "s": beat.doing[:200]}
    return (MARKER + json.dumps(body, separators=(",", ":")) + "\n").encode()


def split_beat(line: str) -> tuple[str, Beat | None]:
    """(the text before a heartbeat in `line`, the heartbeat) or (line, None). Another process's partial line can
    precede a heartbeat in a shared pipe: that text is kept for the log."""
    at = line.find(MARKER)
    if at < 0:
        return line, None
    try:
        body = json.loads(line[at + len(MARKER) :])
        beat = Beat(int(body["p"]), str(body["w"]), int(body.get("r", 0)), str(body.get("s", "")))
    except (ValueError, KeyError, TypeError):
        return line, None
    return line[:at], beat


class StallConfig(Strict):
    """When the flow calls a live component stuck and restarts the attempt (docs/resume.md "Stalls").

    A component working on its own is stuck when its progress counter has not moved for its timeout: the larger
    of its floor here and `pace_factor` x the slowest stretch between two advances it made in this attempt
    (`startup_s` before its first). A component waiting on another is judged by the one it waits on; a server
    with nothing in flight is never stuck. No heartbeat at all for the timeout (a stopped process, a blocked
    event loop) is stuck too."""

    enabled: bool = Field(True, description="watch the components' heartbeats and restart a stuck attempt")
    heartbeat_s: float = Field(2.0, gt=0, le=60, description="how often each component reports its progress")
    startup_s: float = Field(1800.0, gt=0, description="timeout before a component's first progress (loading)")
    trainer_s: float = Field(600.0, gt=0, description="the trainer's (and warm-up's) floor: one micro-batch")
    orchestrator_s: float = Field(600.0, gt=0, description="the orchestrator's floor: one rollout group")
    inference_s: float = Field(600.0, gt=0, description="an inference server's floor (teacher too): one request")
    pace_factor: float = Field(5.0, ge=1, description="timeout = max(floor, factor x slowest observed stretch)")

    def floor_s(self, component: str) -> float:
        """The floor of a component by its flow name (warmup and sft are trainers, teacher is inference)."""
        kind = {"warmup": "trainer", "sft": "trainer", "teacher": "inference"}.get(component, component)
        return float(getattr(self, f"{kind}_s", self.trainer_s))
