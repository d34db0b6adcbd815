"""The shared trainer of a multi-tenant deployment: `python -m engines.trainer.shared --config shared_trainer.json`
(config/process.py's SharedTrainerProcessConfig; docs/multitenant.md).

One process loads the backbone once (DEPLOY_DIR/weights/step=000000, checked against deployment.json's
backbone_sha256) and trains every tenant recorded in DEPLOY_DIR/tenants/ (storage/tenants.py):

    every shared.poll_s: read the records -> a new name joins (a TenantTrainer on its OUTPUT_DIR, sharing the
        backbone's tensors: engines/trainer/tenant.py), a removed one leaves (dropped), a higher attempt is
        rebuilt from its record's resume_step; each tenant's status file is refreshed (its flow's stall watch)
    otherwise: among the tenants whose next step's rollouts are committed, pick one by smooth weighted round
        robin (record.weight) and run exactly that one step of that one tenant (train, publish, report,
        checkpoint: RLTrainer.train_step), so a step never mixes tenants

Each change of a tenant is written to <OUTPUT_DIR>/shared_trainer.json (SharedTrainerStatus: waiting, training,
finished, failed). A tenant that cannot be built or whose step raises is marked failed with the error and
dropped; the others go on. A finished or failed attempt stays so until a higher attempt's record arrives.
DEPLOY_DIR/shared_trainer.json reports each held tenant's share of the trainer time.
Process-global things stay here: the heartbeat (a server's: idle between steps, a step is one piece of work),
SIGUSR1 (checkpoint every tenant after its next step), SIGTERM (stop after the step in progress).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from config.process import SharedTrainerProcessConfig
from config.tenant import SharedTrainerStatus, TenantRecord
from engines.entry import read_process_config
from engines.heartbeat import heartbeat
from engines.models import modeldir
from engines.trainer.common import seed_everything
from engines.trainer.tenant import TenantTrainer, tenant_config
from storage import weights
from storage.fence import Fence, capture, scoped
from storage.fs import Storage, join, read_manifest, write_json
from storage.tenants import read_deployment, read_tenants, write_status

log = logging.getLogger("rollflow.shared_trainer")

IDLE_S = 0.05  # between readiness checks while no tenant has rollouts to train on (the standalone wait's poll)
SHARE_LOG_S = 60.0  # how often the shares go to the log
SUMMARY_FILE = "shared_trainer.json"  # in DEPLOY_DIR: every held tenant's state and share


class RoundRobin:
    """Smooth weighted round robin over the tenants ready at each pick: every ready tenant earns its weight, the
    richest (ties: the first name) is picked and pays the ready tenants' total weight. Tenants that wait earn
    nothing, so over any stretch where a set of tenants is ready their steps go in proportion to their weights."""

    def __init__(self) -> None:
        self.credit: dict[str, float] = {}

    def pick(self, ready: dict[str, float]) -> str | None:
        if not ready:
            return None
        for name, weight in ready.items():
            self.credit[name] = self.credit.get(name, 0.0) + weight
        chosen = min(ready, key=lambda n: (-self.credit[n], n))
        self.credit[chosen] -= sum(ready.values())
        return chosen

    def forget(self, name: str) -> None:
        self.credit.pop(name, None)


@dataclass
class Tenant:
    record: TenantRecord
    status: SharedTrainerStatus
    trainer: TenantTrainer | None = None  # None once finished or failed (its memory is freed)
    final_deadline: float | None = None  # after max_steps: until when its final evaluation is awaited
    steps: int = 0  # steps of this attempt trained by this process
    fence: Fence | None = None  # the tenant run's lease when its attempt joined: its steps write under it only


def load_backbone(cfg: SharedTrainerProcessConfig, sha256: str) -> torch.nn.Module:
    """The backbone's version 0, frozen; SystemExit when it is not the deployment's."""
    if cfg.model.lora is not None:
        raise SystemExit("the shared trainer's [model] is the backbone: it has no [model.lora] (tenants do)")
    fs, root = Storage(cfg.run.storage).open(cfg.run.output_dir)
    v0 = weights.version_dir(root, 0)
    if read_manifest(fs, v0).get("model_sha256") != sha256:
        raise SystemExit(f"{v0} is not the backbone deployment.json names (backbone_sha256 {sha256})")
    model = modeldir.load(cfg.model, pretrained=False).model
    model.load_published(weights.load(fs, v0))
    return model.eval().requires_grad_(False)


class SharedTrainer:
    def __init__(self, cfg: SharedTrainerProcessConfig):
        self.cfg = cfg
        seed_everything(cfg.seed, cfg.trainer.num_threads)
        self.deployment = read_deployment(cfg.deploy_dir)
        self.backbone = load_backbone(cfg, self.deployment.backbone_sha256)
        self.tenants: dict[str, Tenant] = {}
        self.rr = RoundRobin()
        self.stop = threading.Event()
        self.fs, self.root = Storage(cfg.run.storage).open(cfg.deploy_dir)
        self._logged = -float("inf")

    # -- records: join, leave, re-attempt --------------------------------------------------------------------

    def refresh(self) -> None:
        try:
            records, _ = read_tenants(self.cfg.deploy_dir)  # invalid files are skipped and logged there
        except OSError as exc:  # the deployment's storage is away: keep training whom we hold
            log.warning(f"tenant records not read ({exc}); keeping the {len(self.tenants)} held")
            return
        for name in [n for n in self.tenants if n not in records]:
            self._leave(name)
        for name, record in records.items():
            held = self.tenants.get(name)
            if held is None or record.attempt > held.record.attempt:
                if held is not None:
                    self._leave(name)
                self._join(record)
            elif record.attempt == held.record.attempt:
                held.record = record  # a new weight applies from the next pick
        for tenant in self.tenants.values():
            if tenant.trainer is not None:  # alive: refresh `updated` for the tenant flow's stall watch
                self._set(tenant)

    def _join(self, record: TenantRecord) -> None:
        status = SharedTrainerStatus(
            attempt=record.attempt, state="waiting", step=record.resume_step or 0, updated=time.time()
        )
        tenant = self.tenants[record.name] = Tenant(record, status)
        active = sum(t.trainer is not None for t in self.tenants.values())
        if active >= self.cfg.shared.max_tenants:
            return self._fail(tenant, f"the deployment holds shared.max_tenants={active} tenants already")
        t0 = time.perf_counter()
        try:
            cfg = tenant_config(record, self.cfg.model, self.cfg.shared)
            tenant.fence = capture(*Storage(cfg.run.storage).open(record.output_dir))
            tenant.trainer = TenantTrainer(cfg, self.backbone, self.deployment.backbone_sha256)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any refusal stays this tenant's
            return self._fail(tenant, exc)
        finally:
            torch.set_num_threads(self.cfg.trainer.num_threads)  # the tenant's seeding set its own
        log.info(f"tenant {record.name} attempt {record.attempt} joined in {time.perf_counter() - t0:.1f}s")
        self._set(tenant)
        self._after_step(tenant)  # a resume at max_steps has nothing left to train

    @staticmethod
    def _release(tenant: Tenant) -> None:
        """Free the tenant's trainer (its memory), after its MLflow metrics are sent (bounded)."""
        if tenant.trainer is not None:
            tenant.trainer.tracker.close()
            tenant.trainer = None

    def _leave(self, name: str) -> None:
        tenant = self.tenants.pop(name)
        self._release(tenant)
        self.rr.forget(name)
        log.info(f"tenant {name} attempt {tenant.record.attempt} left ({tenant.status.state})")

    # -- stepping --------------------------------------------------------------------------------------------

    def ready(self) -> dict[str, float]:
        """{name: weight} of the tenants whose next step's rollouts are committed."""
        out = {}
        for name, t in self.tenants.items():
            if t.trainer is not None and t.final_deadline is None and t.trainer.ready(t.trainer.next_step):
                out[name] = t.record.weight
        return out

    def step_one(self) -> str | None:
        """Run one step of the next ready tenant; its name, or None when none is ready."""
        name = self.rr.pick(self.ready())
        if name is None:
            return None
        tenant = self.tenants[name]
        assert tenant.trainer is not None
        self._set(tenant, state="training")
        with heartbeat().hold():
            try:
                with scoped(tenant.fence):  # a run taken over (killed, resumed) refuses its old attempt's writes
                    tenant.trainer.train_once()
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - a tenant's failure is its own
                self._fail(tenant, exc, trainer_s=tenant.trainer.trainer_s)
                return name
        trainer, tenant.steps = tenant.trainer, tenant.steps + 1
        self._set(tenant, state="waiting", step=trainer.version, trainer_s=trainer.trainer_s)
        self._after_step(tenant)
        return name

    def _after_step(self, tenant: Tenant) -> None:
        """After max_steps: wait (bounded by eval.final_timeout_s) for the final evaluation, then finished."""
        trainer = tenant.trainer
        if trainer is None or not trainer.done:
            return
        if tenant.final_deadline is None:
            tenant.final_deadline = time.monotonic() + trainer.cfg.eval.final_timeout_s
        if trainer.final_eval_merged() or time.monotonic() > tenant.final_deadline:
            self._release(tenant)
            self._set(tenant, state="finished")
            log.info(f"tenant {tenant.record.name} attempt {tenant.record.attempt} finished")

    # -- status ----------------------------------------------------------------------------------------------

    def _set(self, tenant: Tenant, **changes) -> None:
        tenant.status = tenant.status.model_copy(update={**changes, "updated": time.time()})
        try:
            write_status(tenant.record.output_dir, tenant.status)
        except OSError as exc:  # its storage is down: its flow's stall watch sees the silence
            log.warning(f"tenant {tenant.record.name}: status not written: {exc}")

    def _fail(self, tenant: Tenant, exc: BaseException | str, **changes) -> None:
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        log.error(f"tenant {tenant.record.name} attempt {tenant.record.attempt} failed: {error}")
        self._release(tenant)
        self.rr.forget(tenant.record.name)
        self._set(tenant, state="failed", error=error[:2000], **changes)

    def shares(self) -> dict[str, float]:
        """Each held tenant's share of the trainer time the held tenants took."""
        spent = {n: t.status.trainer_s for n, t in self.tenants.items()}
        total = sum(spent.values())
        return {n: (s / total if total else 0.0) for n, s in spent.items()}

    def write_summary(self) -> None:
        shares = self.shares()
        if time.monotonic() - self._logged >= SHARE_LOG_S and shares:
            self._logged = time.monotonic()
            log.info("trainer time shares: " + ", ".join(f"{n} {s:.0%}" for n, s in sorted(shares.items())))
        tenants = {
            n: {**t.status.model_dump(mode="json"), "weight": t.record.weight, "steps": t.steps, "share": shares[n]}
            for n, t in self.tenants.items()
        }
        try:
            write_json(self.fs, join(self.root, SUMMARY_FILE), {"updated": time.time(), "tenants": tenants})
        except OSError as exc:
            log.warning(f"{SUMMARY_FILE} not written: {exc}")

    # -- the loop --------------------------------------------------------------------------------------------

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Until SIGTERM (`stop`) or `until()`: follow the records every poll_s, step ready tenants between."""
        polled = -float("inf")
        while not self.stop.is_set() and not (until and until()):
            if time.monotonic() - polled >= self.cfg.shared.poll_s:
                polled = time.monotonic()
                self.refresh()
                for tenant in list(self.tenants.values()):
                    self._after_step(tenant)  # tenants awaiting their final evaluation
                self.write_summary()
            if self.step_one() is None:
                time.sleep(IDLE_S)
        self.write_summary()

    def checkpoint_all(self) -> None:
        """SIGUSR1: every held tenant checkpoints after its next step."""
        for tenant in self.tenants.values():
            if tenant.trainer is not None:
                tenant.trainer.checkpoint_now.set()


def main(argv: list[str] | None = None) -> None:
    data = read_process_config("engines.trainer.shared", __doc__, argv)
    beat = heartbeat()
    beat.server = True  # idle while no tenant's step runs; a step must advance
    beat.start_thread()
    trainer = SharedTrainer(SharedTrainerProcessConfig.model_validate(data))
    signal.signal(signal.SIGTERM, lambda *_: trainer.stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: trainer.checkpoint_all())
    log.info(f"shared trainer up: deployment {trainer.cfg.deploy_dir}")
    trainer.run()
    log.info("shared trainer stopped")


if __name__ == "__main__":
    main()
