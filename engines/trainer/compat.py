"""Every place the trainer reaches into torch's or torchtitan's internals, behind a version check.

The trainer's parallelism (engines/trainer/distributed.py, parallel.py, context_parallel.py,
expert_parallel.py) uses torchtitan's public API, and also a few things neither library promises to keep:
a torchtitan module that imports GPU kernels (triton) at import time, torchtitan module globals that pick
the device at import time, torch's fake process-group backend (a testing module), torch's head-tail load
balancer and its context-parallel all-gather op, and the c10d name of a process group. They are all here,
so a torch or torchtitan upgrade is checked in one module.

`check_versions` compares the installed versions (package metadata; nothing is imported) with the ones
these shims were written against, and refuses any other with both named. `distributed.init` calls it before
a multi-rank trainer touches torchtitan; each shim calls it too. A one-process trainer uses none of this.
"""

from __future__ import annotations

import functools
import sys
import types
from importlib import metadata
from typing import Any

import torch

# The versions these shims are known to work with: torch by major.minor (any build: +cpu, +cu128), torchtitan
# by major.minor (0.x minor releases change its API). requirements/constraints.txt pins the same ones.
SUPPORTED = {"torch": "2.13", "torchtitan": "0.3"}

KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"


class UnsupportedVersion(RuntimeError):
    """torch or torchtitan is a version the shims here were not written against."""


def _release(version: str) -> str:
    """`2.13.0+cpu` -> `2.13`: the major.minor part of a version string."""
    return ".".join(version.split("+", 1)[0].split(".")[:2])


def installed_versions() -> dict[str, str]:
    """name -> installed version of each library in SUPPORTED (`not installed` when absent)."""
    found = {}
    for name in SUPPORTED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Raise UnsupportedVersion naming the installed and the supported versions unless every library in
    SUPPORTED is at its supported major.minor. `installed` defaults to the installed package metadata."""
    installed = installed if installed is not None else installed_versions()
    wrong = {name: v for name, v in installed.items() if _release(v) != SUPPORTED[name]}
    if wrong:
        have = ", ".join(f"{name} {v}" for name, v in wrong.items())
        want = ", ".join(f"{name} {v}.*" for name, v in SUPPORTED.items())
        raise UnsupportedVersion(
            f"the trainer's parallelism (trainer.parallel.world_size > 1) runs on {want}; installed: {have}. "
            "Install the supported versions (requirements/constraints.txt; `make install`), or port "
            "engines/trainer/compat.py to the installed ones"
        )


@functools.cache
def require_supported() -> None:
    """`check_versions` once per process."""
    check_versions()


def torchtitan_on_cpu() -> None:
    """Make torchtitan importable and CPU-bound on a machine without a GPU, before anything of it is imported.

    torchtitan imports its triton kernels module at import time (through its expert-parallel dispatchers,
    which the context-parallel API's module imports too): without triton, a stub module stands in for it
    whose names fail only when called. torchtitan's `tools.utils` picks the device at import time: pointed at
    the CPU. torchtitan's mesh gives size-1 axes the "fake" backend, which only a torch testing module registers.
    """
    require_supported()
    if KERNELS_MODULE not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            sys.modules[KERNELS_MODULE] = stub = types.ModuleType(KERNELS_MODULE)
            stub.__getattr__ = _no_kernel  # type: ignore[method-assign]
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu


def _no_kernel(attr: str) -> Any:
    """A name of the stubbed triton kernels module: importable (the all-to-all dispatcher's module imports the
    symmetric-memory dispatcher's kernels), failing only if a GPU-only dispatcher calls it."""
    if attr.startswith("__"):
        raise AttributeError(attr)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torchtitan's triton kernel {attr} needs triton (a GPU); not available here")

    return kernel


def head_tail_order(length: int, cp: int, device_type: str) -> torch.Tensor:
    """[length] the global token positions of a row in the order the cp ranks hold them (rank r: chunks r and
    2cp-1-r of 2cp): torch's head-tail load balancer, the split torchtitan's `cp_shard` makes."""
    require_supported()
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    return _HeadTailLoadBalancer(length, cp, device_type)._generate_indices()[0]


def process_group_name(group: Any) -> str:
    """The c10d name of a process group, which torch's functional collectives take."""
    require_supported()
    import torch.distributed as dist

    return dist._get_process_group_name(group)


def flex_cp_allgather(k: torch.Tensor, v: torch.Tensor, dim: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values all-gathered along `dim` over the group, in rank order; differentiable (its backward
    reduce-scatters the gradients): torch's context-parallel custom op."""
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather as op

    k, v = op(k, v, dim, group_name)
    return k, v
