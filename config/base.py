"""The base of every config model: unknown keys are refused, assignments are validated, numbers are
accepted where text is expected (`mem = 0`, `time_limit = 90`), and a field's profile key (its alias,
where the Python name says more, e.g. `c10d_backend` for `backend`) is what is read and written.

`FLAT_KEYS` lets a section keep keys the seed writes flat in its table while the code reads them from
one sub-model: `[inference] parallel = ...` is read into `inference.vllm.parallel` and written back flat,
so profiles, stored run configs and the code each see one layout. The loader maps error locations back
to the profile's keys with `profile_loc`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, serialize_by_alias=True
    )

    # field -> keys of that field's model which the profile writes flat in this model's table
    FLAT_KEYS: ClassVar[dict[str, tuple[str, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_keys(cls, data: Any) -> Any:
        if not cls.FLAT_KEYS or not isinstance(data, dict):
            return data
        data = dict(data)
        for name, keys in cls.FLAT_KEYS.items():
            inner = data.get(name)
            nested = sorted(set(inner) & set(keys)) if isinstance(inner, dict) else []
            if nested:  # one spelling per key: the profile's
                raise ValueError(
                    f"`{name}.{nested[0]}` is written `{nested[0]}`, in this table itself (not under `{name}`)"
                )
            flat = {k: data.pop(k) for k in keys if k in data}
            if flat:
                inner = inner.model_dump(exclude_unset=True) if isinstance(inner, BaseModel) else dict(inner or {})
                data[name] = {**inner, **flat}
        return data

    @model_serializer(mode="wrap")
    def _write_flat_keys(self, handler: Any) -> Any:
        data = handler(self)
        for name, keys in self.FLAT_KEYS.items():
            inner = data.get(name)
            if isinstance(inner, dict):  # absent under model_dump(exclude=...)
                data.update({k: inner.pop(k) for k in keys if k in inner})
        return data


def field_named(model: type[BaseModel], key: str) -> str | None:
    """The Python name of the field a profile key (an alias or a name) sets, or None."""
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return name
    return None


def flat_keys(model: type[BaseModel], name: str) -> tuple[str, ...]:
    """The keys of `model`'s field `name` that the profile writes flat in `model`'s table."""
    return model.FLAT_KEYS.get(name, ()) if issubclass(model, Strict) else ()


def profile_keys(model: type[BaseModel], written_above: tuple[str, ...] = ()) -> list[str]:
    """The keys a profile may write in `model`'s table; `written_above`: its keys written one table up."""
    keys = [info.alias or name for name, info in model.model_fields.items()]
    keys += [k for name in model.model_fields for k in flat_keys(model, name)]
    return sorted(k for k in keys if k not in written_above)
