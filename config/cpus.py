"""CPU binding of a local run's components: which cores the inference server and the trainer may run on.

`[deployment.cpus]` can give each of the two heavy components cores of its own, so generation and training do not
fight for the same ones. Off by default: on 2 cores `auto` lowered the default profile's async overlap to 0.90 of
ideal from 0.97 unbound (docs/benchmarks.md, benchmark 1), because the orchestrator and Prefect then share a
bound core; it is for machines with cores to spare.

Data flow: profile `[deployment.cpus]` -> `CpuBindingConfig` (validated here) -> the flow, at each attempt, calls
`plan(binding, usable, ...)` with the cores this process may use (`os.sched_getaffinity(0)`) -> a `CpuPlan`:
component name -> a Linux CPU list ("0-3,8"), or none for a component left unbound -> the component's
environment as `ROLLFLOW_CPUS` -> the component binds itself before it starts work (engines/entry.py), and the
inference server splits its cores between the vLLM servers it starts (`split`, VLLM_CPU_OMP_THREADS_BIND).

Modes:
- "off": nothing bound (every component may run anywhere; the kernel places threads).
- "auto": inference gets the first `inference_threads` usable cores, the trainer the next `trainer_threads`; the
  orchestrator and the teacher share what is left, or run anywhere when nothing is; the warm-up, which runs
  alone before them, runs anywhere. When the two do not fit side by side, nothing is bound and `CpuPlan.reason`
  says why.
- "manual": the lists given, each checked against the usable cores.
Inside a Slurm job srun places the components (`deployment.slurm`); this section is for local runs.
Imports only pydantic and the standard library, like the rest of config/.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.base import Strict

CPUS_ENV = "ROLLFLOW_CPUS"  # a component's cores, as a Linux CPU list; unset: unbound
CPU_LIST = re.compile(r"\d{1,4}(-\d{1,4})?(,\d{1,4}(-\d{1,4})?)*")
SHARING = ("orchestrator", "teacher")  # what is left over, or anywhere (the warm-up runs alone: anywhere)


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; ValueError naming the text when it is not a CPU list."""
    if not CPU_LIST.fullmatch(text):
        raise ValueError(f"{text!r} is not a CPU list (numbers and ranges separated by commas, e.g. '0-3,8')")
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"{text!r}: the range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, cpus = [], sorted(set(cpus))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def split(cpus: list[int], n: int) -> list[list[int]]:
    """`cpus` in `n` contiguous, as even as possible, non-empty shares; fewer cores than shares: every share
    gets all of them (the servers then share cores rather than one getting none)."""
    if n <= 0:
        raise ValueError(f"split into {n} shares: need at least 1")
    if len(cpus) < n:
        return [list(cpus) for _ in range(n)]
    size, extra = divmod(len(cpus), n)
    out, at = [], 0
    for k in range(n):
        step = size + (1 if k < extra else 0)
        out.append(list(cpus[at : at + step]))
        at += step
    return out


class CpuBindingConfig(Strict):
    """`[deployment.cpus]`: CPU binding of a local run's components (this module's docstring)."""

    mode: Literal["off", "auto", "manual"] = Field(
        "off", description="off: unbound; auto: inference and trainer on disjoint cores; manual: the lists below"
    )
    inference: str | None = Field(None, description="manual: the inference server's cores, e.g. '0-3'")
    trainer: str | None = Field(None, description="manual: the trainer's cores, e.g. '4-7'")
    orchestrator: str | None = Field(None, description="manual: the orchestrator's (and teacher's); None: anywhere")

    @field_validator("inference", "trainer", "orchestrator")
    @classmethod
    def _cpu_list(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_list(value)
        return value

    @model_validator(mode="after")
    def _lists_match_mode(self) -> CpuBindingConfig:
        given = [k for k in ("inference", "trainer", "orchestrator") if getattr(self, k) is not None]
        if self.mode != "manual" and given:
            raise ValueError(
                f"deployment.cpus.{given[0]} is set but deployment.cpus.mode={self.mode!r}: "
                "CPU lists are read only with mode = 'manual'"
            )
        if self.mode == "manual" and (self.inference is None or self.trainer is None):
            raise ValueError("deployment.cpus.mode='manual' needs deployment.cpus.inference and .trainer CPU lists")
        return self


@dataclass(frozen=True)
class CpuPlan:
    """Component name -> its CPU list; a component absent runs anywhere. `reason`: why nothing is bound."""

    cpus: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    def env(self, component: str) -> dict[str, str]:
        """The component's `ROLLFLOW_CPUS`, or nothing when it is unbound."""
        return {CPUS_ENV: self.cpus[component]} if component in self.cpus else {}

    def describe(self) -> str:
        if not self.cpus:
            return f"CPU binding off ({self.reason})" if self.reason else "CPU binding off"
        return "CPU binding: " + ", ".join(f"{k} on {v}" for k, v in self.cpus.items())


def plan(binding: CpuBindingConfig, usable: set[int], inference_threads: int, trainer_threads: int) -> CpuPlan:
    """Where each component runs, from the cores this process may use (see the module docstring)."""
    if binding.mode == "off":
        return CpuPlan(reason="deployment.cpus.mode = 'off'")
    if binding.mode == "manual":
        return _manual(binding, usable)
    cores = sorted(usable)
    need = inference_threads + trainer_threads
    if need > len(cores):
        return CpuPlan(
            reason=f"inference ({inference_threads}) + trainer ({trainer_threads}) threads exceed the "
            f"{len(cores)} usable core(s) {format_cpu_list(cores)}"
        )
    out = {
        "inference": format_cpu_list(cores[:inference_threads]),
        "trainer": format_cpu_list(cores[inference_threads:need]),
    }
    if rest := cores[need:]:
        out |= {name: format_cpu_list(rest) for name in SHARING}
    return CpuPlan(out)


def _manual(binding: CpuBindingConfig, usable: set[int]) -> CpuPlan:
    out = {}
    for name in ("inference", "trainer", "orchestrator"):
        text = getattr(binding, name)
        if text is None:
            continue
        if missing := set(parse_cpu_list(text)) - usable:
            raise ValueError(
                f"deployment.cpus.{name}={text!r}: core(s) {format_cpu_list(sorted(missing))} are not usable "
                f"here (usable: {format_cpu_list(sorted(usable))})"
            )
        out[name] = text
    if "orchestrator" in out:
        out["teacher"] = out["orchestrator"]
    return CpuPlan(out)
