"""The embedded engine: one worker thread runs a continuous batch of queued requests with a KV cache.

HTTP handlers enqueue `Request`s and await their futures. Between decode steps the worker applies
pending weight updates (in-flight, as PipelineRL does), admits queued requests into the running batch
(their prompts are prefilled and their rows join it) and hands each request its new tokens (streaming)
and, once all its rows have ended, its completions. Every completion records the policy versions that
produced its first and last token. A request's images (a vision-language model) travel with it to the
prefill (generate.py), so such rows join a running batch as any other. With `record_routes`
(`inference.enable_return_routed_experts`, MoE models) it also records the experts each token was routed to.

A shared server's model has adapter slots (engines/models/lora.py `MultiLoRALinear`, docs/multitenant.md): a
request names its tenant's slot and the lease under which the slot is the tenant's, its rows carry the slot
through the batch, and each slot has its own policy version and pending updates (`update_slot`), applied between
decode steps like the base's and touching only that slot's rows. `close_slot` (the tenant left or restarted)
fails that slot's queued and running requests and clears it before the next step. Nothing is cached across
requests (each request's KV lives in its rows only), so no state of one tenant or version reaches another's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engines.inference.embedded.generate import Completion, Decoder, Refused, Sampling
from engines.models import lora
from engines.models.decoder import CausalLM
from engines.seeds import row_seeds

# For each of a request's rows that drew a token this step: (choice index, token id, logprob, finished,
# policy version that produced it, finish reason (meaningful once finished), its top logprobs or None)
TokenEvents = list[tuple[int, int, float, bool, int, str, list[tuple[int, float]] | None]]


@dataclass
class Request:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    seed: int | None = None  # the same seed and prompt draw the same samples, whatever the batch
    top_k: int = 0
    top_p: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    # makes each row's stop-string check (which keeps per-row state): given the row's tokens, True ends it
    stop: Callable[[], Callable[[list[int]], bool]] | None = None
    top_logprobs: int = 0  # also the k most likely (token, logprob) per position
    kept_sizes: bool = False  # also each token's kept support size (top-k / top-p truncation)
    prompt_logprobs: int | None = None  # also score the prompt's tokens, with this many alternatives
    on_tokens: Callable[[TokenEvents], None] | None = None  # called from the engine thread after each step
    # a vision-language model's prompt images (bytes, prompt order; checked against prompt_ids by the front end)
    images: tuple[bytes, ...] = ()
    # a shared server's tenant: its adapter slot, and the lease under which the slot was its (a stale lease: the
    # tenant left or restarted, and the request fails rather than run on whatever the slot holds now)
    slot: int = 0
    lease: int = 0
    future: Future = field(default_factory=Future)

    def sampling(self, seed: int) -> list[Sampling]:
        return [
            Sampling(
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=s,
                top_k=self.top_k,
                top_p=self.top_p,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                stop=self.stop() if self.stop is not None else None,
                top_logprobs=self.top_logprobs,
                kept_sizes=self.kept_sizes,
                prompt_logprobs=self.prompt_logprobs,
                slot=self.slot,
            )
            for s in row_seeds(seed, self.n)
        ]


@dataclass
class _PendingUpdate:
    state_dict: dict
    version: int
    applied: Future = field(default_factory=Future)  # resolves to the version served afterwards
    slot: int = 0  # > 0: a tenant's adapters (`state_dict` holds only them) for that slot, with `scaling`
    scaling: float = 0.0
    lease: int = 0


class TenantGone(Exception):
    """The request's or update's tenant left the shared server (or restarted) before it was served."""


@dataclass
class _Closing:
    slot: int
    error: Exception
    done: Future = field(default_factory=Future)


@dataclass
class _Running:
    """A request in the batch: its completions and which of them are still running."""

    request: Request
    outs: list[Completion]
    left: int


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
        continuous: bool = True,
    ):
        self.model = model.eval()
        # False: requests that arrive while a batch runs wait for it to end (the static batcher; the
        # baseline of benchmark 2's arrival figure)
        self.continuous = continuous
        self.record_routes = record_routes
        self.version = version
        self.eos_id, self.pad_id = eos_id, pad_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._cv = threading.Condition()
        self._queue: list[Request] = []
        self._pending: list[_PendingUpdate] = []
        self._aborted: list[Request] = []  # running requests to drop before the next step
        # a shared server (model with adapter slots): each open slot's served version and lease, and the slots
        # being closed (their rows leave the batch, then their adapters are cleared, before the next step)
        self.slot_versions: dict[int, int] = {}
        self._leases: dict[int, int] = {}
        self._closing: list[_Closing] = []
        self._busy = False
        self._stopped = False
        self.stats = {"batches": 0, "joins": 0, "steps": 0, "sequences": 0, "tokens": 0, "updates": 0, "aborted": 0}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        self.submit_many([request])
        return request.future

    def submit_many(self, requests: list[Request]) -> None:
        """Queue `requests` at once (they join the batch together when they fit)."""
        with self._cv:
            for request in requests:
                if request.slot and self._leases.get(request.slot) != request.lease:
                    request.future.set_exception(TenantGone("the tenant left or restarted"))
                else:
                    self._queue.append(request)
            self._cv.notify()

    def abort(self, request: Request) -> None:
        """Stop working on `request` (its client went away): a queued one leaves the queue, a running one's
        rows leave the batch before the next step; its future resolves with the tokens drawn so far
        (finish reason "abort"). A request already resolved is left as it is."""
        with self._cv:
            if request in self._queue:
                self._queue.remove(request)
                self.stats["aborted"] += 1
                request.future.set_result([Completion(finish_reason="abort", finished=True) for _ in range(request.n)])
            elif not request.future.done():
                self._aborted.append(request)

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

    def open_slot(self, slot: int, lease: int) -> None:
        """Give adapter slot `slot` (> 0, free) to a tenant under `lease`; it serves no version (-1) until loaded."""
        with self._cv:
            if slot in self._leases or any(c.slot == slot for c in self._closing):
                raise ValueError(f"adapter slot {slot} is not free")
            self._leases[slot], self.slot_versions[slot] = lease, -1

    def update_slot(
        self, slot: int, lease: int, adapters: dict, scaling: float, version: int, timeout: float = 600.0
    ) -> int:
        """Serve `adapters` (checked by the caller: lora.check_slot_adapter) as slot `slot`'s `version` from the
        next decode step on; only that slot's rows see it. Returns the slot's served version; TenantGone when the
        slot is no longer the lease's."""
        return self.queue_slot_update(slot, lease, adapters, scaling, version).result(timeout)

    def queue_slot_update(self, slot: int, lease: int, adapters: dict, scaling: float, version: int) -> Future:
        """`update_slot` without waiting: the future resolves to the slot's served version once applied."""
        update = _PendingUpdate(adapters, version, slot=slot, scaling=scaling, lease=lease)
        with self._cv:
            if self._leases.get(slot) != lease:
                raise TenantGone(f"adapter slot {slot} is no longer this tenant's")
            self._pending.append(update)
            if not self._busy:
                self._apply_pending_locked()
        return update.applied

    def close_slot(self, slot: int, error: Exception, timeout: float = 600.0) -> None:
        """Take slot `slot` back: its queued and running requests fail with `error` (nobody else's), then its
        adapters are cleared; returns once the slot is free."""
        closing = _Closing(slot, error)
        with self._cv:
            self._leases.pop(slot, None)
            self.slot_versions.pop(slot, None)
            for req in [r for r in self._queue if r.slot == slot]:
                self._queue.remove(req)
                req.future.set_exception(error)
            self._closing.append(closing)
            if not self._busy:
                self._clear_closed_locked()
        closing.done.result(timeout)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _apply_pending_locked(self) -> None:
        """Apply the queued updates, per slot (0: the base weights) the newest; a failure fails that slot's."""
        if not self._pending:
            return
        updates, self._pending = self._pending, []
        for slot in sorted({u.slot for u in updates}):
            group = [u for u in updates if u.slot == slot]
            if slot:
                stale = [u for u in group if self._leases.get(slot) != u.lease]
                for u in stale:
                    u.applied.set_exception(TenantGone(f"adapter slot {slot} is no longer this tenant's"))
                group = [u for u in group if u not in stale]
            if group:
                self._apply_group(slot, group)

    def _apply_group(self, slot: int, group: list[_PendingUpdate]) -> None:
        newest = max(group, key=lambda u: u.version)
        try:
            if slot == 0 and newest.version > self.version:
                self.model.load_published(newest.state_dict)
                self.version = newest.version
                self.stats["updates"] += 1
            elif slot and newest.version > self.slot_versions[slot]:
                lora.fill_slot(self.model, slot, newest.state_dict, newest.scaling)
                self.slot_versions[slot] = newest.version
                self.stats["updates"] += 1
        except Exception as exc:
            for u in group:
                u.applied.set_exception(exc)
            return
        served = self.slot_versions[slot] if slot else self.version
        for u in group:
            u.applied.set_result(served)

    def _clear_closed_locked(self) -> None:
        """Clear the adapters of the slots being closed (their rows are out of the batch) and free them."""
        closing, self._closing = self._closing, []
        for c in closing:
            try:
                lora.fill_slot(self.model, c.slot, {}, 0.0)
            except Exception as exc:  # never: clearing is zeroing; the slot stays closed either way
                c.done.set_exception(exc)
                continue
            c.done.set_result(None)

    def _between_steps(self) -> tuple[int, dict[int, int]]:
        """Apply pending updates; the versions (base, and per open slot) the next forward computes with."""
        with self._cv:
            self._apply_pending_locked()
            return self.version, dict(self.slot_versions)

    def _wait_for_work(self) -> bool:
        """Block until a request is queued (True) or the engine stops (False)."""
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            self._busy = not self._stopped
            return self._busy

    def _take(self, rows: int) -> list[Request]:
        """Queued requests, in order, that fit beside `rows` running rows (the first always fits an empty batch)."""
        with self._cv:
            taken: list[Request] = []
            while self._queue and not self._stopped and (rows == 0 or rows + self._queue[0].n <= self.max_batch_size):
                req = self._queue.pop(0)
                taken.append(req)
                rows += req.n
            return taken

    def _loop(self) -> None:
        while self._wait_for_work():
            running: dict[int, tuple[_Running, int]] = {}  # origin -> (request, choice index)
            try:
                self._serve(running)
            except Exception as exc:  # a failed step fails the requests in the batch, not the server
                for entry, _ in running.values():
                    if not entry.request.future.done():
                        entry.request.future.set_exception(exc)
            finally:
                with self._cv:
                    self._busy = False
                    self._clear_closed_locked()
                    self._apply_pending_locked()

    def _serve(self, running: dict[int, tuple[_Running, int]]) -> None:
        """Run the batch until it is empty and nothing is queued: admit, sample, deliver, update, forward."""
        decoder = Decoder(self.model, self.eos_id, self.pad_id, self.record_routes)
        version, slots = self._between_steps()
        self._admit(decoder, running)
        self.stats["batches"] += 1
        while decoder.live and not self._stopped:
            self._deliver(decoder.sample(version, slots), running)
            self.stats["steps"] += 1
            self._drop_gone(decoder, running)
            version, slots = self._between_steps()
            if decoder.live:
                decoder.forward()
            if self.continuous or not decoder.live:
                self._admit(decoder, running)

    def _admit(self, decoder: Decoder, running: dict[int, tuple[_Running, int]]) -> None:
        """Prefill the queued requests that fit and add their rows to the running batch. A request that
        cannot join (a bad sampling value, a failed prefill) fails alone: the others join without it."""
        taken = self._take(decoder.live)
        if not taken:
            return
        try:
            self._join(decoder, running, taken)
        except Refused:  # some of them cannot join: find which, each joining on its own
            for req in taken:
                self._join(decoder, running, [req])
        self.stats["joins"] += 1

    def _join(self, decoder: Decoder, running: dict[int, tuple[_Running, int]], taken: list[Request]) -> None:
        """Add `taken` to the batch. When they cannot join (Refused) the batch is unchanged: one request alone
        then fails, several raise Refused. Any other failure is the batch's: it fails them all."""
        prompts, params, images = [], [], []
        for req in taken:
            seed = req.seed if req.seed is not None else int(torch.randint(2**62, (1,), generator=self.generator))
            prompts += [req.prompt_ids] * req.n
            params += req.sampling(seed)
            images += [req.images] * req.n
        try:
            made = decoder.add(prompts, params, images if any(images) else None)
        except Refused as exc:  # the batch is as it was: only these requests fail
            if len(taken) == 1:
                taken[0].future.set_exception(exc.__cause__ or exc)
                return
            raise
        except Exception as exc:  # the batch itself failed: they are not in `running` yet, so fail them here
            for req in taken:
                req.future.set_exception(exc)
            raise
        start = 0
        for req in taken:
            rows = made[start : start + req.n]
            entry = _Running(req, [c for _, c in rows], req.n)
            running.update({origin: (entry, i) for i, (origin, _) in enumerate(rows)})
            start += req.n

    def _drop_gone(self, decoder: Decoder, running: dict[int, tuple[_Running, int]]) -> None:
        """Take the rows of aborted requests (resolved with what they have) and of closing slots (failed with
        the slot's error) out of the batch; then clear the closing slots' adapters."""
        with self._cv:
            aborted, self._aborted = {id(r) for r in self._aborted}, []
            closing = {c.slot: c.error for c in self._closing}
            if not aborted and not closing:
                return
            rows = [o for o, (e, _) in running.items() if id(e.request) in aborted or e.request.slot in closing]
            decoder.drop(rows)
            for o in rows:
                entry, _ = running.pop(o)
                entry.left -= 1
                if entry.left == 0 and entry.request.slot in closing:
                    entry.request.future.set_exception(closing[entry.request.slot])
                elif entry.left == 0:
                    self.stats["aborted"] += 1
                    entry.request.future.set_result(entry.outs)
            self._clear_closed_locked()

    def _deliver(self, stepped: list[int], running: dict[int, tuple[_Running, int]]) -> None:
        """Hand each request its new tokens; resolve the requests whose rows have all ended."""
        events: dict[int, tuple[_Running, TokenEvents]] = {}
        for origin in stepped:
            entry, i = running[origin]
            c = entry.outs[i]
            top = c.top_logprobs[-1] if c.top_logprobs else None
            event = (i, c.token_ids[-1], c.logprobs[-1], c.finished, c.policy_version_end, c.finish_reason, top)
            events.setdefault(id(entry), (entry, []))[1].append(event)
            self.stats["tokens"] += 1
            if c.finished:
                del running[origin]
                entry.left -= 1
        for entry, items in events.values():
            if entry.request.on_tokens is not None:
                try:
                    entry.request.on_tokens(items)
                except Exception:  # a listener that went away (client disconnected) must not fail the batch
                    entry.request.on_tokens = None
            if entry.left == 0:
                self.stats["sequences"] += len(entry.outs)
                failed = next((c.error for c in entry.outs if c.error is not None), None)
                if failed is not None:  # its own check failed (a stop check raised): it alone fails
                    entry.request.future.set_exception(failed)
                else:
                    entry.request.future.set_result(entry.outs)


__all__ = ["Completion", "Engine", "Request", "TenantGone"]
