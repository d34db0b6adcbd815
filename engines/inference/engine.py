"""The embedded engine: one worker thread batches queued requests and samples them with a KV cache.

HTTP handlers enqueue `Request`s and await their futures. Weight updates are applied between decode
steps of a running batch (in-flight, as PipelineRL does), or at once when the engine is idle; every
completion records the policy versions that produced its first and last token. With `record_routes`
(`inference.enable_return_routed_experts`, MoE models) it also records the experts each token was routed to.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engines.generate import Completion, generate
from engines.model import CausalLM
from engines.sampling import row_seeds


@dataclass
class Request:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    seed: int | None = None  # the same seed and prompt draw the same samples, whatever the batch
    future: Future = field(default_factory=Future)


@dataclass
class _PendingUpdate:
    state_dict: dict
    version: int
    applied: Future = field(default_factory=Future)  # resolves to the version served afterwards


class Engine:
    def __init__(
        self,
        model: CausalLM,
        version: int,
        eos_id: int,
        pad_id: int,
        max_batch_size: int,
        seed: int,
        record_routes: bool = False,
    ):
        self.model = model.eval()
        self.record_routes = record_routes
        self.version = version
        self.eos_id, self.pad_id = eos_id, pad_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._cv = threading.Condition()
        self._queue: list[Request] = []
        self._pending: list[_PendingUpdate] = []
        self._busy = False
        self._stopped = False
        self.stats = {"batches": 0, "sequences": 0, "tokens": 0, "updates": 0}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        with self._cv:
            self._queue.append(request)
            self._cv.notify()
        return request.future

    def update_weights(self, state_dict: dict, version: int, timeout: float = 600.0) -> int:
        """Apply new weights before the next decode step (or now if idle); returns the serving version.

        The weights are checked against the model first, so a bad publication fails here and the
        served policy stays as it was. Updates queued while a batch runs collapse into the newest.
        """
        self.model.check_published(state_dict)
        update = _PendingUpdate(state_dict, version)
        with self._cv:
            self._pending.append(update)
            if not self._busy:
                self._apply_pending_locked()
        return update.applied.result(timeout)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _apply_pending_locked(self) -> None:
        if not self._pending:
            return
        updates, self._pending = self._pending, []
        newest = max(updates, key=lambda u: u.version)
        try:
            if newest.version > self.version:
                self.model.load_published(newest.state_dict)
                self.version = newest.version
                self.stats["updates"] += 1
        except Exception as exc:
            for u in updates:
                u.applied.set_exception(exc)
            return
        for u in updates:
            u.applied.set_result(self.version)

    def _between_steps(self) -> int:
        with self._cv:
            self._apply_pending_locked()
            return self.version

    def _take_batch(self) -> list[Request] | None:
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            batch: list[Request] = []
            rows = 0
            while self._queue and (not batch or rows + self._queue[0].n <= self.max_batch_size):
                req = self._queue.pop(0)
                batch.append(req)
                rows += req.n
            self._busy = True
            return batch

    def _loop(self) -> None:
        while (batch := self._take_batch()) is not None:
            try:
                self._run(batch)
            except Exception as exc:  # a failed batch fails its requests, not the server
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
            finally:
                with self._cv:
                    self._busy = False
                    self._apply_pending_locked()

    def _run(self, batch: list[Request]) -> None:
        prompts, limits, temps, seeds = [], [], [], []
        for req in batch:
            prompts += [req.prompt_ids] * req.n
            limits += [req.max_tokens] * req.n
            temps += [req.temperature] * req.n
            seed = req.seed if req.seed is not None else int(torch.randint(2**62, (1,), generator=self.generator))
            seeds += row_seeds(seed, req.n)
        outs = generate(
            self.model,
            prompts,
            max_new_tokens=limits,
            temperatures=temps,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            seeds=seeds,
            between_steps=self._between_steps,
            record_routes=self.record_routes,
        )
        self.stats["batches"] += 1
        self.stats["sequences"] += len(outs)
        self.stats["tokens"] += sum(len(c.token_ids) for c in outs)
        start = 0
        for req in batch:
            req.future.set_result(outs[start : start + req.n])
            start += req.n


__all__ = ["Completion", "Engine", "Request"]
