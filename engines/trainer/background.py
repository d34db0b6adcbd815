"""The trainer's writes that need not hold up its next step: weight publications and checkpoints, written in
order by one thread while the training loop goes on (`trainer.background_writes`, a single trainer process).

Data flow: the loop copies what a write needs at step N (the weights it publishes, a checkpoint's captured state,
engines/trainer/checkpoint.py `capture(copy=True)`) and `submit`s the write; the thread runs the writes in the
order they came (publication N, checkpoint N, publication N+1, ...), so storage sees the same sequence as
when the loop wrote them itself. At most `depth` writes are in flight: a loop that outruns storage waits in
`submit`. A write that fails raises on the loop's thread, at its next `submit` or `wait`; every wait for a
write is bounded by `timeout_s`. A write cut short (the process killed) leaves no manifest, so nothing half
written is ever read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


def copied(tree: Any) -> Any:
    """`tree` (tensors in dicts, lists and tuples) with every tensor copied: what a write reads while the loop
    changes the originals."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: copied(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(copied(v) for v in tree)
    return tree


class Writes:
    def __init__(self, timeout_s: float, depth: int = 2):
        self.timeout_s, self.depth = timeout_s, depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer-writes")
        self._pending: deque[tuple[str, Future]] = deque()

    def submit(self, name: str, write: Callable[[], object]) -> None:
        """Queue `write` (named in errors, e.g. "checkpoint step=5") after those in flight."""
        self._settle(self.depth - 1)
        self._pending.append((name, self._pool.submit(write)))

    def wait(self) -> None:
        """Until every submitted write is done."""
        self._settle(0)

    def _settle(self, keep: int) -> None:
        """Collect finished writes, oldest first, and wait until at most `keep` are in flight."""
        while self._pending and (len(self._pending) > keep or self._pending[0][1].done()):
            name, future = self._pending.popleft()
            try:
                future.result(self.timeout_s)
            except TimeoutError:
                if not future.done():
                    raise TimeoutError(f"{name}: still being written after {self.timeout_s:.0f}s") from None
                raise
