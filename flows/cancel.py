"""How a flow run ended, for state.json: `finished`, `cancelled` (a person cancelled it in Prefect) or `failed`.

A cancellation from the UI or `prefect flow-run cancel` puts the flow run (or a parent of it: the scheduled
`resume-unfinished` run that started this `rl` as a subflow) in Cancelling, then the worker stops the process
with SIGTERM, which reaches the flow's code as Prefect's TerminationSignal. On the way out the flow asks the API
whether its run or a parent was being cancelled; a run recorded `cancelled` is left alone by the scheduled
resumption (storage/runstate.py `RESUMABLE`) until someone resumes it with `rollflow resume`. Any error asking
(no API, a timeout) counts as not cancelled: the run is recorded `failed`, resumable as before.
"""

from __future__ import annotations

from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

MAX_DEPTH = 5  # subflow nesting looked through: rl under resume-unfinished is 2


def cancel_requested(logger) -> bool:
    """Whether this flow run or one of its parents is Cancelling or Cancelled in the Prefect API."""
    run_id = flow_run.get_id()
    if run_id is None:
        return False
    try:
        with get_client(sync_client=True) as client:
            current: UUID | None = UUID(str(run_id))
            for _ in range(MAX_DEPTH):
                if current is None:
                    return False
                run = client.read_flow_run(current)
                if run.state is not None and (run.state.is_cancelling() or run.state.is_cancelled()):
                    return True
                current = client.read_task_run(run.parent_task_run_id).flow_run_id if run.parent_task_run_id else None
    except Exception as exc:  # noqa: BLE001 - an unanswered question leaves the run resumable, as before
        logger.warning(f"could not ask Prefect whether this run was cancelled ({type(exc).__name__}: {exc})")
    return False


def outcome(finished: bool, logger) -> str:
    if finished:
        return "finished"
    if cancel_requested(logger):
        logger.warning("the flow run was cancelled: recorded as cancelled; `rollflow resume` continues it")
        return "cancelled"
    return "failed"
