"""When a soak fault counts as recovered, and how many steps it cost, read from the run directory.

A fault stops an attempt (or a whole flow); the next attempt rolls the run back to its last complete
checkpoint (storage/resume.py truncates metrics.jsonl to it) and trains again. Recovered: metrics.jsonl was
written after the new attempt began and holds more steps than that checkpoint, i.e. the new attempt recorded
a trainer step (the truncation alone does not count). Rolled back: the steps recorded before the stop minus
that checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the integration suite's helpers

from test_resume import _checkpoints, _trained_steps  # noqa: E402


def resume_point(out: Path, recorded: int) -> int:
    """The checkpoint a run that had recorded `recorded` steps restarts from."""
    return max((c for c in _checkpoints(out) if c <= recorded), default=0)


def stepped_since(out: Path, began_wall: float, recorded: int) -> bool:
    """The attempt that began at `began_wall` (time.time()) has recorded a trainer step of its own."""
    metrics = out / "metrics.jsonl"
    try:
        written = metrics.stat().st_mtime
    except FileNotFoundError:
        return False
    return written > began_wall and _trained_steps(out) > resume_point(out, recorded)
