"""A task's prompt as the inference server takes it: token ids, and for a task with images the images too.

    Task(prompt, images=()) -> tok.render_prompt(prompt)                                  (text: as always)
    Task(prompt, images)    -> tok.render_messages([{user: [{"type": "image"}] * n + [{"type": "text", ...}]}])
                            -> vision.expand(ids, sizes, spec): each placeholder widened to its image's tokens
                               (engines/environments/multimodal.py, which the load check measures with too)
                            -> Prompt(ids, images) -> CompletionRequest(prompt=ids, images=base64 of each)

Multimodal-safe truncation: a prompt with images is never cut. One whose ids plus `max_new_tokens` would
overflow `model.max_seq_len` is dropped before any request, its group's samples counted as `overflow_dropped`
(the step's manifest, docs/rollouts.md), and so is one with an image that breaks vision.py's bounds
(`image_refused`): bad input never stops a run. The pool replaces a dropped group with a new one
(engines/orchestrator/pool.py), so the step still commits `batch_size` groups; MAX_DROP_STREAK drops in a row
(every task overflowing, say) refuse the run instead of redrawing forever. Tasks with images for a model without
a vision encoder are refused (EnvironmentRefused): every restart would draw them again.
"""

from __future__ import annotations

import base64
import logging
from collections import Counter
from dataclasses import dataclass

from engines.environments import multimodal
from engines.environments.base import EnvironmentRefused, Task
from engines.models.tokenizer import Tokenizer
from engines.models.vision import ImageError

log = logging.getLogger("rollflow.orchestrator")

# Prompts with images dropped in a row, with none rendered between them, before the run is refused.
MAX_DROP_STREAK = 64


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    images: tuple[bytes, ...] = ()

    def request_fields(self) -> dict:
        """The CompletionRequest fields that carry the images (none for a text prompt)."""
        return {"images": [base64.b64encode(b).decode() for b in self.images]} if self.images else {}


class Prompts:
    """Renders tasks for one model. `max_seq_len` None: no overflow check (the server's own 400 applies).
    `counts` gathers the drops until `take_counts` hands them to the step that commits next."""

    def __init__(self, tok: Tokenizer, max_seq_len: int | None, max_new_tokens: int):
        self.tok, self.max_seq_len, self.max_new_tokens = tok, max_seq_len, max_new_tokens
        self.spec = multimodal.vision_spec(tok)
        self.counts: Counter[str] = Counter()
        self.streak = 0

    def render(self, task: Task, samples: int = 1) -> Prompt | None:
        """The prompt of `task`, or None: dropped, its `samples` counted (see the module docstring)."""
        images = multimodal.images_of(task)
        if not images:
            return Prompt(self.tok.render_prompt(task.prompt))
        try:
            ids = multimodal.prompt_ids(self.tok, task, self.spec)
        except ImageError as exc:
            self._drop("image_refused", samples, f"{exc}")
            return None
        if self.max_seq_len is not None and len(ids) + self.max_new_tokens > self.max_seq_len:
            why = f"{len(ids)} prompt tokens + max_new_tokens {self.max_new_tokens}"
            why += f" > model.max_seq_len {self.max_seq_len}"
            self._drop("overflow_dropped", samples, why)
            return None
        self.streak = 0
        return Prompt(ids, images)

    def _drop(self, count: str, samples: int, why: str) -> None:
        self.counts[count] += samples
        self.streak += 1
        log.warning(f"prompt with images dropped ({count}): {why}")
        if self.streak >= MAX_DROP_STREAK:
            raise EnvironmentRefused(
                f"{self.streak} prompts with images in a row were dropped, the last one as {count}: {why}; "
                "raise model.max_seq_len (or lower orchestrator.max_new_tokens, or fewer/smaller images)"
            )

    def take_counts(self) -> dict[str, int]:
        """The drops since the last call (the step's manifest fields), then zero."""
        counts, self.counts = dict(self.counts), Counter()
        return counts
