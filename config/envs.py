"""One environment of the task mix."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.base import Strict
from config.registry import ENVIRONMENTS, one_of


class EnvSpec(Strict):
    """One environment in the task mix; `name` picks an implementation from config/registry.py."""

    name: str
    weight: float = Field(1.0, gt=0)
    min_chars: int = Field(3, gt=0)
    max_chars: int = Field(8, gt=0)
    lengths: Literal["uniform", "long-tail"] = Field(
        "uniform", description="payload length distribution; long-tail: mostly min_chars, rarely max_chars"
    )
    prompt: Literal["auto", "tag", "instruct"] = Field(
        "auto",
        description="tag: `rev:abc` (the built-in model's format); instruct: a sentence for chat models; "
        "auto: what the tokenizer suits (tag for the character tokenizer, instruct for Hugging Face ones)",
    )

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        return one_of("environment", name, ENVIRONMENTS)

    @model_validator(mode="after")
    def _range(self) -> EnvSpec:
        if self.min_chars > self.max_chars:
            raise ValueError(f"env {self.name}: min_chars={self.min_chars} > max_chars={self.max_chars}")
        return self
