"""Supervised fine-tuning settings: `[sft]` and where its samples come from, `[sft.data]`.

One trainer (engines/trainer/sft.py) serves two uses: the RL warm-up (data `type = "envs"`: the
environments' reference answers, published as policy version 0) and `rollflow sft` (any source,
checkpointed and published as `weights/step=N`). `[sft.data]` picks the source by `type`; without one,
`path` means files and `run` means a lake, so `[sft.data] path = "chat.jsonl"` is enough.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from config.base import Strict

BadRowPolicy = Literal["error", "skip"]
BAD_ROW = (
    "a row the trainer cannot use (missing column, no assistant turn, unknown role, longer than model.max_seq_len): "
    "`error` refuses the dataset naming the file and row; `skip` drops it and counts it"
)


class EnvDemoData(Strict):
    """The environments' reference answers (multi-turn: their demonstrations): the RL warm-up's data, an
    endless stream of tasks, so the run lasts `sft.steps`."""

    type: Literal["envs"] = "envs"


class FileData(Strict):
    """Chat conversations in files: a `messages` column of [{role, content}, ...] per row."""

    type: Literal["files"] = "files"
    path: str = Field(
        description="a file, a glob (`data/*.parquet`) or a directory; a local path or a URL (`s3://b/p/`), read "
        "with the run's [storage] settings"
    )
    format: Literal["auto", "jsonl", "parquet", "arrow", "hf"] = Field(
        "auto",
        description="auto: by extension (.jsonl/.json, .parquet, .arrow/.ipc), and a directory holding "
        "dataset_info.json is a Hugging Face `save_to_disk` dataset (hf)",
    )
    messages_column: str = Field("messages", min_length=1, description="the column holding each conversation")
    on_bad_row: BadRowPolicy = Field("error", description=BAD_ROW)


class LakeData(Strict):
    """Rollouts of a run's lake, filtered (rejection-sampling fine-tuning), read from its shards in place."""

    type: Literal["lake"] = "lake"
    run: str = Field(description="the output_dir of the run whose rollouts/ are read (a path or a URL)")
    steps: str | None = Field(None, description="rollout steps `N`, `A:B` (inclusive), `A:` or `:B`")
    env: str | None = Field(None, description="only this environment's samples (its lake name)")
    min_reward: float | None = Field(None, description="keep samples with reward >= this")
    max_reward: float | None = Field(None, description="keep samples with reward <= this")
    limit: int | None = Field(None, gt=0, description="at most this many samples, in step order")
    tokens: Literal["ids", "text"] = Field(
        "ids",
        description="ids: the stored prompt_ids + completion_ids, trained on the completion's model tokens (the "
        "same tokenizer); text: prompt_text and completion_text rendered through this model's chat template",
    )
    on_bad_row: BadRowPolicy = Field("error", description=BAD_ROW)

    @model_validator(mode="after")
    def _steps_syntax(self) -> LakeData:
        if self.steps is not None:
            lo, sep, hi = self.steps.partition(":")
            if not all(p.strip().isdigit() for p in (lo, hi) if p) or not (lo or hi):
                raise ValueError(f"steps = {self.steps!r}: expected N, A:B, A: or :B with integers")
        return self


def _source(data: Any) -> str:
    if not isinstance(data, dict):
        return getattr(data, "type", "envs")
    if "type" in data:
        return str(data["type"])
    return "files" if "path" in data else "lake" if "run" in data else "envs"


SFTData = Annotated[
    Annotated[EnvDemoData, Tag("envs")] | Annotated[FileData, Tag("files")] | Annotated[LakeData, Tag("lake")],
    Discriminator(_source),
]


class SFTConfig(Strict):
    """Supervised fine-tuning: the RL warm-up (published as policy version 0) or a `rollflow sft` run."""

    steps: int = Field(200, ge=0, description="optimizer steps (unless `epochs` is set)")
    epochs: int | None = Field(
        None,
        gt=0,
        description="passes over a dataset; when set, the run lasts ceil(epochs x samples / batch_size) steps",
    )
    batch_size: int = Field(32, gt=0, description="samples per optimizer step")
    lr: float = Field(3e-3, gt=0)
    packing: bool = Field(
        False, description="several samples per row (block-diagonal attention), rows of model.max_seq_len tokens"
    )
    micro_batch_size: int | None = Field(
        None, gt=0, description="rows per forward/backward (gradients accumulate); None: the whole batch at once"
    )
    data: SFTData = Field(EnvDemoData(), description="where the samples come from: [sft.data] (docs/sft.md)")

    @model_validator(mode="after")
    def _epochs_need_a_dataset(self) -> SFTConfig:
        if self.epochs is not None and self.data.type == "envs":
            raise ValueError(
                "sft.epochs counts passes over a dataset; the environments' demonstrations (sft.data.type = "
                "'envs') are an endless stream: set sft.steps instead, or [sft.data] path / run"
            )
        return self
