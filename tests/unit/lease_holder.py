"""A stand-in flow for the lease tests: a real process that holds a run's lease (runtime/lease.py) and commits.

    python lease_holder.py flow ROOT TTL HOST       hold the lease as host HOST and commit commits/<owner>-<n>.json
                                                    every 50 ms until the fence refuses (exit 3) or 60 s pass
    python lease_holder.py supervise ROOT TTL HOST  hold it and run `component` as a supervised child, stopped
                                                    when the lease is lost (exit 3 then)
    python lease_holder.py component ROOT           commit in a loop, fenced by $ROLLFLOW_FENCE from its parent

Each commit goes through storage.fs.write_json, the atomic write every run-directory commit uses (without
fsync, see NO_FSYNC). Lines on
stdout: `held <generation>`, `committed <n>`, `fenced: <why>`.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.storage import StorageConfig  # noqa: E402
from runtime.lease import hold_lease  # noqa: E402
from runtime.process import ComponentFailed, supervise  # noqa: E402
from storage import fence, runstate  # noqa: E402
from storage.fs import get_fs, join, write_json  # noqa: E402

# No fsync: on a disk shared with other jobs an fsync can stall for seconds, which is not what these tests time.
NO_FSYNC = StorageConfig(fsync=False)


class Say:
    def __getattr__(self, level):
        return lambda msg: print(f"{level}: {msg}", flush=True)


def commit_loop(root: str, tag: str, seconds: float = 60.0) -> int:
    fs, path = get_fs(root, NO_FSYNC)
    n = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            write_json(fs, join(path, "commits", f"{tag}-{n:05d}.json"), {"n": n, "at": time.time()})
        except runstate.LeaseLost as exc:
            print(f"fenced: {exc}", flush=True)
            return 3
        print(f"committed {n}", flush=True)
        n += 1
        time.sleep(0.05)
    return 0


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "component":
        return commit_loop(root, f"component-{fence.active().generation}")  # type: ignore[union-attr]
    ttl, host = float(sys.argv[3]), sys.argv[4]
    runstate.this_host = lambda: host  # another "host": no pid shortcut for whoever looks at this lease
    fs, path = get_fs(root, NO_FSYNC)
    with hold_lease(fs, path, ttl, Say()) as lease:
        print(f"held {lease.lease.generation}", flush=True)
        if mode == "flow":
            return commit_loop(root, f"flow-{lease.lease.generation}")
        stop = threading.Event()
        lease.attach(stop)
        argv = [sys.executable, __file__, "component", root]
        try:
            supervise("component", argv, {}, lambda line: print(f"[component] {line}", flush=True), stop, grace_s=5)
        except ComponentFailed as exc:  # the component's own fence refused before the flow stopped it
            print(f"component failed: {exc}", flush=True)
            # as the flow's next attempt would: the keeper's next renewal (within ttl / RENEWALS_PER_TTL) finds the
            # lease taken; a component fenced first only means its commit came before that renewal
            lease.fence.lost.wait(timeout=ttl)
        print(f"component stopped; lease lost: {lease.lost}", flush=True)
        return 3 if lease.lost else 0


if __name__ == "__main__":
    sys.exit(main())
