"""A task with images as a model sees it: one user message of content parts, rendered by the model's chat template
and widened by the model's image token layout. Shared by the orchestrator (engines/orchestrator/prompts.py, which
sends these ids) and the load check (engines/environments/loadcheck.py, which measures them against
model.max_seq_len before a run starts).

    Task(prompt, images) -> user_message: [{"type": "image"}] * len(images) + [{"type": "text", "text": prompt}]
        -> tok.render_messages -> one <|image_pad|> per image -> vision.expand -> each widened to its token count
"""

from __future__ import annotations

import json
from pathlib import Path

from engines.environments.base import EnvironmentRefused, Task
from engines.models import vision
from engines.models.tokenizer import Tokenizer
from engines.models.vision import ImageError, VisionSpec


def vision_spec(tok: Tokenizer) -> VisionSpec | None:
    """The image token layout of the tokenizer's model directory when it is a vision-language model (its
    config.json has a vision_config); None for the built-in model and text-only models."""
    directory = getattr(tok, "directory", None)
    if directory is None or not (Path(directory) / "config.json").is_file():
        return None
    config = json.loads((Path(directory) / "config.json").read_text())
    return VisionSpec.from_directory(directory) if isinstance(config, dict) and "vision_config" in config else None


def images_of(task: Task) -> tuple[bytes, ...]:
    """A task's images; () for a text task, also one of a plugin's own task type without the field."""
    return tuple(getattr(task, "images", ()) or ())


def user_message(task: Task) -> dict:
    """The task as one user message: its images first, then its text (OpenAI-style content parts); a text-only
    task's message is its prompt, as the text environments have always been rendered."""
    images = images_of(task)
    if not images:
        return {"role": "user", "content": task.prompt}
    return {"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": task.prompt}]}


def image_sizes(task: Task) -> list[tuple[int, int]]:
    """(width, height) of each image, or ImageError for one over vision.py's bounds (or too many)."""
    images = images_of(task)
    if len(images) > vision.MAX_IMAGES:
        raise ImageError(f"{len(images)} images in one prompt, over the limit of {vision.MAX_IMAGES}")
    return [vision.image_size(b, f"{task.env} image {i}") for i, b in enumerate(images)]


def prompt_ids(tok: Tokenizer, task: Task, spec: VisionSpec | None) -> list[int]:
    """The task's first prompt ids with every image placeholder expanded. EnvironmentRefused where no task with
    images can ever be rendered (a text-only model, a chat template without one placeholder per image part);
    ImageError for this task's images alone."""
    if not images_of(task):
        return tok.render_prompt(task.prompt)
    if spec is None:
        where = getattr(tok, "directory", None) or "the built-in model"
        raise EnvironmentRefused(
            f"environment {task.env!r} draws tasks with images, but {where} is not a vision-language model "
            "(its config.json has no vision_config): set model.path to one (docs/models.md, Images)"
        )
    sizes = image_sizes(task)
    ids = tok.render_messages([user_message(task)])
    try:
        return vision.expand(ids, sizes, spec)
    except ImageError as exc:  # placeholders and images disagree: the template's doing, for every task alike
        raise EnvironmentRefused(f"the model's chat template cannot render images: {exc}") from None
