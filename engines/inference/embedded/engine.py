"""The embedded engine: one worker thread runs a continuous batch of queued requests with a KV cache.

HTTP handlers enqueue `Request`s and await their futures. Between decode steps the worker applies
pending weight updates (in-flight, as PipelineRL does), admits queued requests into the running batch
(their prompts are prefilled and their rows join it) and hands each request its new tokens (streaming)
and, once all its rows have ended, its completions. Every completion records the policy versions that
produced its first and last token. A request's images (a vision-language model) travel with it to the
prefill (generate.py), so such rows join a running batch as any other. With `record_routes`
(`inference.enable_return_routed_experts`, MoE models) it also records the experts each token was routed to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engines.inference.embedded.generate import Completion, Decoder, Refused, Sampling
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
            )
            for s in row_seeds(seed, self.n)
        ]


@dataclass
class _PendingUpdate:
    state_dict: dict
    version: int
    applied: Future = field(default_factory=Future)  # resolves to the version served afterwards


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
        self._busy = False
        self._stopped = False
        self.stats = {"batches": 0, "joins": 0, "steps": 0, "sequences": 0, "tokens": 0, "updates": 0, "aborted": 0}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        with self._cv:
            self._queue.append(request)
            self._cv.notify()
        return request.future

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
                    self._apply_pending_locked()

    def _serve(self, running: dict[int, tuple[_Running, int]]) -> None:
        """Run the batch until it is empty and nothing is queued: admit, sample, deliver, update, forward."""
        decoder = Decoder(self.model, self.eos_id, self.pad_id, self.record_routes)
        version = self._between_steps()
        self._admit(decoder, running)
        self.stats["batches"] += 1
        while decoder.live and not self._stopped:
            self._deliver(decoder.sample(version), running)
            self.stats["steps"] += 1
            self._drop_aborted(decoder, running)
            version = self._between_steps()
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

    def _drop_aborted(self, decoder: Decoder, running: dict[int, tuple[_Running, int]]) -> None:
        """Take the aborted requests' rows out of the batch and resolve them with what they have."""
        with self._cv:
            aborted, self._aborted = {id(r) for r in self._aborted}, []
        if not aborted:
            return
        rows = [o for o, (entry, _) in running.items() if id(entry.request) in aborted]
        decoder.drop(rows)
        for o in rows:
            entry, _ = running.pop(o)
            entry.left -= 1
            if entry.left == 0:
                self.stats["aborted"] += 1
                entry.request.future.set_result(entry.outs)

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


__all__ = ["Completion", "Engine", "Request"]
