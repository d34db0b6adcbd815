"""The soak's faults: each injects one fault into a running `Run` and returns once the injection is over.

A fault returns (note, restarts): what happened in words, and whether the run's attempt restarts because of it
(then recovery is only counted once a new trainer process records a step). Kinds (FaultRecord.kind):
  sigkill:{trainer,orchestrator,inference}  SIGKILL one component; the flow restarts the attempt
  sigkill:{flow,tree}      SIGKILL the CLI (flow) process, or it and every descendant; the driver resumes
  sigstop:{...}            SIGSTOP a component past its stall timeout; the flow must detect and restart it
  corrupt:{shard,publication,checkpoint}  tree kill, then truncate or bit-flip the newest one, then resume:
                           verify-on-read must catch it and fall back (docs/resume.md "What a resume does")
  resume:second            a second `rollflow resume` of the live run: it must be refused (never two writers)
  disk:full                a ballast file fills the run's tmpfs until ENOSPC, held, then removed
  s3:outage                every S3 request through the FaultProxy fails (503, reset or stall) for 20-40 s
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from storage.runstate import pid_alive
from tests.integration.conftest import cli_argv, cli_env
from tests.s3util import FaultProxy
from tests.soak.run import Run

STOP_DETECT_S = 120.0  # SIGSTOP to the process gone, at most (the stall timeout, a poll, the stop)


@dataclass
class Ctx:
    run: Run
    rng: random.Random
    snapshots: dict[int, str] = field(default_factory=dict)  # rollout manifests seen committed (local runs)
    proxy: FaultProxy | None = None
    disk: Path | None = None  # the tmpfs mount that holds the run (local segment)
    disk_hold_s: float = 20.0
    outage_s: tuple[float, float] = (20.0, 40.0)
    problems: list[str] = field(default_factory=list)


def sigkill(ctx: Ctx, target: str) -> tuple[str, bool]:
    if target in ("flow", "tree"):
        ctx.run.kill(tree=target == "tree")
        ctx.run.resume()
        return "killed; resumed with `rollflow resume`", True
    pid = ctx.run.pid(target)
    if pid is None:
        return f"no {target} process to kill (the run ended)", False
    os.kill(pid, signal.SIGKILL)
    return f"pid {pid}", True


def sigstop(ctx: Ctx, target: str) -> tuple[str, bool]:
    pid = ctx.run.pid(target)
    if pid is None:
        return f"no {target} process to stop (the run ended)", False
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    while pid_alive(pid) and time.monotonic() - t0 < STOP_DETECT_S:
        time.sleep(0.1)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        ctx.problems.append(f"SIGSTOPped {target} (pid {pid}) not detected in {STOP_DETECT_S:.0f} s")
        return "NOT detected: killed by the driver", True
    return f"stopped by the flow {time.monotonic() - t0:.1f} s after SIGSTOP", True


def _newest(out: Path, what: str) -> Path | None:
    """The file to damage: the newest committed shard, weight publication or checkpoint's weights. A shard only
    past the newest checkpoint: the restart reads those again (and verifies them); a shard already trained on is
    never read by the run again, so its damage would be found by nobody but a reader of the lake."""
    parent, sub, pattern = {
        "shard": ("rollouts", "", "part-*.arrow"),
        "publication": ("weights", "", "model.safetensors"),
        "checkpoint": ("checkpoints", "trainer", "model.safetensors"),
    }[what]
    dirs = sorted(d / sub if sub else d for d in (out / parent).glob("step=*"))
    committed = [d for d in dirs if (d / "_manifest.json").exists() and list(d.glob(pattern))]
    if what == "shard":
        trained = [int(m.parent.parent.name[5:]) for m in (out / "checkpoints").glob("step=*/trainer/_manifest.json")]
        committed = [d for d in committed if int(d.name[5:]) > max(trained, default=0)]
    return sorted(committed[-1].glob(pattern))[0] if committed else None


def corrupt(ctx: Ctx, what: str) -> tuple[str, bool]:
    out = Path(ctx.run.out)
    ctx.run.kill(tree=True)
    victim = _newest(out, what)
    how = "no committed one past the newest checkpoint: nothing corrupted"
    if victim is not None:
        data = bytearray(victim.read_bytes())
        if ctx.rng.random() < 0.5:
            victim.write_bytes(bytes(data[: len(data) // 2]))
            how = f"truncated {victim.relative_to(out)} to {len(data) // 2} bytes"
        else:
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
            how = f"flipped a byte of {victim.relative_to(out)}"
        if what == "shard":  # the resume removes it and samples the step again: a new manifest is expected
            ctx.snapshots.pop(int(victim.parent.name[5:]), None)
    ctx.run.resume()
    return f"{how}; resumed", True


def second_resume(ctx: Ctx) -> tuple[str, bool]:
    argv = cli_argv("resume", ctx.run.out)
    try:
        done = subprocess.run(argv, cwd=ctx.run.workdir, env=cli_env(ctx.run.api), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    except subprocess.TimeoutExpired:
        ctx.problems.append("a second `rollflow resume` of the live run neither ended nor was refused in 120 s")
        return "second resume still running after 120 s", False
    text = done.stdout + done.stderr
    if done.returncode == 0:
        ctx.problems.append("a second `rollflow resume` of the live run succeeded: two writers")
        return "NOT refused: it ran", False
    refused = any(m in text for m in ("refusing to touch it", "already being run", "LeaseHeld"))
    if not refused:
        ctx.problems.append(f"the second resume failed without the lease refusal: {text[-300:]}")
    return f"refused (rc {done.returncode}, lease held)" if refused else f"failed rc {done.returncode}", False


def disk_full(ctx: Ctx) -> tuple[str, bool]:
    assert ctx.disk is not None
    ballast, written = ctx.disk / "ballast", 0
    chunk = b"\0" * (1 << 20)
    try:
        with open(ballast, "wb") as f:
            while True:
                f.write(chunk)
                f.flush()
                written += 1
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    time.sleep(ctx.disk_hold_s)
    ballast.unlink()
    return f"{written} MiB ballast until ENOSPC, held {ctx.disk_hold_s:.0f} s, removed", False


def s3_outage(ctx: Ctx) -> tuple[str, bool]:
    assert ctx.proxy is not None
    kind, seconds = ctx.rng.choice(["503", "reset", "stall"]), ctx.rng.uniform(*ctx.outage_s)
    before = ctx.proxy.injected.get(kind, 0)
    ctx.proxy.outage(kind)
    time.sleep(seconds)
    ctx.proxy.heal()
    return f"{kind} for {seconds:.0f} s ({ctx.proxy.injected.get(kind, 0) - before} requests faulted)", False


def injector(kind: str) -> Callable[[Ctx], tuple[str, bool]]:
    what, _, target = kind.partition(":")
    table: dict[str, Callable[[Ctx], tuple[str, bool]]] = {
        "sigkill": lambda c: sigkill(c, target),
        "sigstop": lambda c: sigstop(c, target),
        "corrupt": lambda c: corrupt(c, target),
        "resume": second_resume,
        "disk": disk_full,
        "s3": s3_outage,
    }
    return table[what]
