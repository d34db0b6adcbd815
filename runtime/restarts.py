"""When a flow restarts its components after a failure, and when it gives up: shared by the `rl` and `sft`
flows. Failures count in a row while attempts restart from the same checkpoint; an attempt that starts from
a newer one (progress) resets the count. The wait before a restart doubles each time, up to a cap.
"""

from __future__ import annotations

from config.run import RestartConfig


class RestartsExhausted(RuntimeError):
    """Components kept failing without the run making checkpoint progress."""


class RestartBudget:
    def __init__(self, cfg: RestartConfig):
        self.cfg, self.failures, self.last_start = cfg, 0, -2

    def attempt_from(self, step: int | None) -> None:
        """An attempt starts from checkpoint `step` (None: from the beginning)."""
        start = -1 if step is None else step
        self.failures = 0 if start > self.last_start else self.failures
        self.last_start = start

    def failed(self, exc: BaseException) -> float:
        """The attempt failed with `exc`: the seconds to wait before the next one, or RestartsExhausted."""
        self.failures += 1
        if self.failures > self.cfg.max_restarts:
            raise RestartsExhausted(
                f"{self.failures} failures in a row without checkpoint progress (restart.max_restarts="
                f"{self.cfg.max_restarts}); last: {exc}"
            ) from exc
        return min(self.cfg.backoff_s * 2 ** (self.failures - 1), self.cfg.backoff_max_s)

    def notice(self, exc: BaseException, delay: float) -> str:
        """What the flow logs before it waits `delay` seconds and restarts."""
        return f"{exc}\nrestart {self.failures}/{self.cfg.max_restarts} from the last checkpoint in {delay:.1f}s"
