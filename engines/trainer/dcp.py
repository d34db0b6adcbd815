"""The optimizer's part of a trainer checkpoint, through torch.distributed.checkpoint (DCP).

Save: every rank hands DCP its shard of the optimizer state, keyed by parameter name
(`get_optimizer_state_dict`), and DCP writes one file per rank plus `.metadata` under
`checkpoints/step=N/trainer/optimizer/`; rank 0 then checksums them into the checkpoint's manifest (written
last, storage/checkpoints.py). Load: every rank verifies those files against the manifest and DCP reads
the slices its own shards need, whatever the number of ranks that wrote them (2 -> 1, 1 -> 2 ...), never
unpickling anything but DCP's metadata classes and plain data (engines/trainer/dcp_safe.py).
Object stores: DCP writes into a local staging directory and rank 0 uploads the files (one node).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import fsspec

from engines.trainer.distributed import Dist
from storage.checkpoints import OPTIMIZER_DIR
from storage.fs import MANIFEST, CorruptError, is_local, join, local_path, read_verified

METADATA = ".metadata"  # DCP's index of the shards (a pickle: read only through engines/trainer/dcp_safe.py)


def _shared_tmp(d: Dist) -> str:
    """A staging directory every rank of this node agrees on (rank 0 creates it)."""
    path = [tempfile.mkdtemp(prefix="rollflow-dcp-") if d.is_main else ""]
    if d.enabled:
        import torch.distributed as dist

        dist.broadcast_object_list(path, src=0)
    return path[0]


def save_optimizer(
    fs: fsspec.AbstractFileSystem, directory: str, optimizer_state: dict[str, Any], d: Dist
) -> tuple[list[str], dict[str, bytes]]:
    """Write this rank's optimizer state (`get_optimizer_state_dict`'s, keyed by parameter name; a collective).
    Rank 0 gets (names written in place, staged files to commit)."""
    import torch.distributed.checkpoint as dcp

    state = {"optimizer": optimizer_state}
    local = is_local(fs)
    target = join(directory, OPTIMIZER_DIR) if local else _shared_tmp(d)
    Path(target).mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(target), no_dist=not d.enabled)
    if not d.is_main:
        return [], {}
    names = sorted(p.name for p in Path(target).iterdir() if p.is_file())
    if local:
        return [f"{OPTIMIZER_DIR}/{n}" for n in names], {}
    staged = {f"{OPTIMIZER_DIR}/{n}": (Path(target) / n).read_bytes() for n in names}
    shutil.rmtree(target, ignore_errors=True)
    return [], staged


def load_optimizer(
    fs: fsspec.AbstractFileSystem, directory: str, manifest: dict, model: Any, optimizer: Any, d: Dist
) -> None:
    """Verify the checkpoint's DCP files and load this rank's share of the optimizer state (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from engines.trainer.dcp_safe import VerifiedReader, WeightsOnlyPlanner

    names = [n for n in manifest["files"] if n.startswith(f"{OPTIMIZER_DIR}/")]
    if not names:
        raise RuntimeError(f"{directory}: the checkpoint holds no optimizer state ({OPTIMIZER_DIR}/ files)")
    data = {n: read_verified(fs, directory, n, manifest) for n in names}  # every rank checks what it reads
    meta_name = f"{OPTIMIZER_DIR}/{METADATA}"
    if meta_name not in data:
        raise CorruptError(f"{join(directory, MANIFEST)}: lists no {meta_name}")
    source = join(directory, OPTIMIZER_DIR) if is_local(fs) else _stage(directory, data)
    try:
        rel = {n.split("/", 1)[1] for n in names}
        reader = VerifiedReader(source, data[meta_name], join(directory, meta_name), rel)
        state = {"optimizer": _saved_keys_only(get_optimizer_state_dict(model, optimizer), reader)}
        planner = WeightsOnlyPlanner(join(directory, OPTIMIZER_DIR))
        try:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not d.enabled)
        except CheckpointException as exc:  # DCP wraps each rank's error: a refused file reads as what it is
            raise next((e for e, _ in exc.failures.values() if isinstance(e, CorruptError)), exc) from None
    finally:
        if not is_local(fs):  # the staged copy of an object-store checkpoint
            shutil.rmtree(source, ignore_errors=True)
    # strict=False: the parameters _saved_keys_only left out stay without state
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))


def _stage(directory: str, data: dict[str, bytes]) -> str:
    """A local copy of an object-store checkpoint's verified DCP files (names checked: they stay inside it)."""
    source = tempfile.mkdtemp(prefix="rollflow-dcp-")
    for n, b in data.items():
        target = Path(local_path(source, n.split("/", 1)[1], join(directory, MANIFEST)))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b)
    return source


def _saved_keys_only(template: dict, reader: Any) -> dict:
    """The load template without the parameters the checkpoint holds no state for. AdamW keeps no state for a
    parameter that never had a gradient (an expert no token was routed to), while the template, built from a
    fresh optimizer, has state for all: loading that key would fail, and filling it would start the
    parameter's step count at 1 instead of 0, so it stays without state, as in the run that saved it."""
    prefix = "optimizer.state."  # DCP's flattened keys: optimizer.state.<parameter fqn>.<state name>
    meta = reader.read_metadata().state_dict_metadata
    saved = {key[len(prefix) :].rsplit(".", 1)[0] for key in meta if key.startswith(prefix)}
    kept = {name: value for name, value in template["state"].items() if name in saved}
    return {**template, "state": kept}
