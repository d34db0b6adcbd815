"""A shared deployment end to end (docs/multitenant.md): `rollflow shared up` on tiny-cpu's backbone, two tenant
runs with different environments and LoRA ranks attached to it at once through the real CLI and processes,
each run to completion with its own lake passing the resume audit, then `rollflow shared down`
(the helpers: tests/integration/shared_deploy.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from shared_deploy import TENANT, check_tenant, shared_deployment, shut_down, write_profile

MAX_STEPS = 4

pytestmark = pytest.mark.long


def _tenant_b(tmp_path: Path) -> Path:
    """Another environment and another rank than tenant a's (tiny-cpu-lora: both string tasks, rank 8)."""
    return write_profile(
        tmp_path / "tenant-b.toml",
        'run_name = "tenant-b"\n[model.lora]\nrank = 4\nalpha = 8.0\n'
        '[[envs]]\nname = "sort-letters"\nmin_chars = 3\nmax_chars = 6\n',
    )


def test_two_tenants_share_one_deployment_to_completion(tmp_path, prefect_api):
    with shared_deployment(tmp_path, prefect_api) as dep:
        t0 = time.monotonic()
        tenants = {}
        try:
            for name, extra in (("tenant-a", []), ("tenant-b", [_tenant_b(tmp_path)])):
                tenants[name] = dep.tenant(name, [*TENANT, *extra])
            for name, cli in tenants.items():
                assert cli.wait(timeout=600) == 0, dep.tail(name)
        finally:
            for cli in tenants.values():
                if cli.poll() is None:
                    cli.kill()
                    cli.wait()
        t_tenants = time.monotonic() - t0
        for name in tenants:
            check_tenant(tmp_path / name, dep.record["backbone_sha256"], MAX_STEPS)
        assert list((dep.dir / "tenants").glob("*.json")) == []  # each run removed its record as it ended
        shut_down(dep)
        print(f"deployment up in {dep.up_s:.0f}s; two tenants x {MAX_STEPS} steps in {t_tenants:.0f}s")
