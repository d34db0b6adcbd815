"""engines/trainer/compat.py: the version check accepts the installed torch and torchtitan and refuses any
other naming both versions; each shim does what it says (in a fresh process: they patch torchtitan's modules)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.trainer import compat

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_versions_are_the_supported_ones():
    installed = compat.installed_versions()
    assert installed["torch"].startswith(compat.SUPPORTED["torch"] + ".")
    assert installed["torchtitan"].startswith(compat.SUPPORTED["torchtitan"] + ".")
    compat.check_versions()  # no error


def test_another_build_of_a_supported_release_passes():
    compat.check_versions({"torch": f"{compat.SUPPORTED['torch']}.1+cu128", "torchtitan": "0.3.2"})


@pytest.mark.parametrize(
    ("installed", "named"),
    [
        ({"torch": "2.14.0+cpu", "torchtitan": "0.3.0"}, "torch 2.14.0+cpu"),
        ({"torch": "2.13.0+cpu", "torchtitan": "0.4.0"}, "torchtitan 0.4.0"),
        ({"torch": "2.13.0", "torchtitan": "not installed"}, "torchtitan not installed"),
        ({"torch": "2.1.0", "torchtitan": "0.3.0"}, "torch 2.1.0"),  # a prefix of 2.13 is not 2.13
    ],
)
def test_another_version_is_refused_naming_installed_and_supported(installed, named):
    with pytest.raises(compat.UnsupportedVersion) as exc:
        compat.check_versions(installed)
    message = str(exc.value)
    assert f"installed: {named}" in message
    assert "runs on torch 2.13.*, torchtitan 0.3.*" in message
    assert "engines/trainer/compat.py" in message


def test_head_tail_order_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    order = compat.head_tail_order(8, 2, "cpu")
    assert order.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    order = compat.head_tail_order(12, 3, "cpu").view(3, -1)
    assert order.tolist() == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]


SHIMS = """
import sys, torch
import torch.distributed as dist
from engines.trainer import compat

compat.torchtitan_on_cpu()
stub = sys.modules[compat.KERNELS_MODULE]
try:
    import triton
    has_triton = True
except ImportError:
    has_triton = False
print("triton:", has_triton)
if not has_triton:
    try:
        stub.some_kernel(1, 2)
    except RuntimeError as exc:
        print("kernel:", exc)
    print("dunder:", hasattr(stub, "__wrapped__"))
from torchtitan.distributed.context_parallel.api import cp_shard  # imports the kernels module by name
import torchtitan.tools.utils as tt_utils
print("device:", tt_utils.device_type, tt_utils.device_module is torch.cpu)
print("fake backend:", "fake" in dist.Backend.backend_list)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
name = compat.process_group_name(dist.group.WORLD)
k, v = torch.randn(1, 2, 3, 4, requires_grad=True), torch.randn(1, 2, 3, 4)
gk, gv = compat.flex_cp_allgather(k, v, 2, name)
print("gather:", isinstance(name, str), torch.equal(gk, k), torch.equal(gv, v), gk.requires_grad)
dist.destroy_process_group()
"""


def test_the_shims_in_a_fresh_process():
    out = subprocess.run(
        [sys.executable, "-c", SHIMS], cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env()
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    if lines["triton"] == "False":  # the stub stands in for the kernels module
        assert lines["kernel"] == "torchtitan's triton kernel some_kernel needs triton (a GPU); not available here"
        assert lines["dunder"] == "False"  # dunder lookups are not kernels: the module stays introspectable
    assert lines["device"] == "cpu True"
    assert lines["fake backend"] == "True"
    assert lines["gather"] == "True True True True"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
