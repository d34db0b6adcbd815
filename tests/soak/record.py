"""What a soak segment reports: the faults it injected, how each was recovered, its audit and its memory.

Every segment (a run of one profile under one fault schedule: local, S3, Slurm, the namespace cluster) returns a
`SegmentResult`; tests/soak/report.py pools the segments into docs/reliability.md's tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class FaultRecord:
    """One injected fault. `kind` is `<what>:<target>`, e.g. sigkill:trainer, sigstop:inference, sigkill:rank,
    sigkill:flow, sigkill:tree, s3:outage, disk:full, corrupt:shard, corrupt:publication, corrupt:checkpoint,
    resume:second, slurm:preempt, slurm:walltime, node:loss."""

    kind: str
    at_s: float  # seconds since the segment started
    recover_s: float | None  # injection to the next trainer step recorded after it; None: never recovered
    rolled_back: int  # trained steps redone because of it (steps recorded before it minus the resume point)
    note: str = ""


@dataclass
class SegmentResult:
    name: str
    profile: str
    steps: int  # max_steps of the run
    wall_s: float
    faults: list[FaultRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the audit's findings; empty: it passed
    rss_mb: dict[str, tuple[float, float]] = field(default_factory=dict)  # process -> (first, last) sample
    fault_free_wall_s: float | None = None  # the same run without faults, when measured
    rss_slope_kb_per_step: dict[str, float] = field(default_factory=dict)  # process -> RSS growth per trained step
    seed: int | None = None

    def to_json(self) -> dict:
        return asdict(self)
