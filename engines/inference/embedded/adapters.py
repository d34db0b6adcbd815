"""A tenant's adapter publications as the shared server reads them (docs/multitenant.md).

A tenant run publishes into its own OUTPUT_DIR: version 0 is its copy of the deployment's backbone (a full
publication whose model_sha256 is the backbone's), every later version an adapter publication (storage/weights.py
`encoding: "lora"`) whose `lora_base.model_sha256` names the base it was trained on. The shared server reads only
the adapter file (PEFT names -> model names, storage/lora.py) and its scaling, never the tenant's base copy: the
base is the backbone it already serves, which the sha256 check proves (engines/inference/tenants.py `locate`). `Unfit`
is a publication this deployment can never serve (another base, a rank over max_lora_rank, a layer the backbone
lacks): the tenant is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec
import torch

from engines.inference.tenants import Unfit, locate
from engines.models import lora
from storage.fs import read_verified
from storage.lora import ADAPTER_CONFIG, ADAPTER_FILE, from_peft, scaling


@dataclass
class Adapter:
    version: int
    tensors: dict[str, torch.Tensor]  # model names; empty: the backbone itself (version 0)
    scaling: float
    directory: str


def read_adapter(fs: fsspec.AbstractFileSystem, root: str, version: int | None, model, backbone: str, rank: int):
    """Publication `version` (None: the newest committed) of the tenant run at `root`, checked against the served
    `model`'s slots: its base must be the backbone (model_sha256 `backbone`), its rank at most `rank`."""
    p = locate(fs, root, version, backbone)
    if not p.lora:
        return Adapter(p.version, {}, 0.0, p.directory)
    tensors = from_peft(_load(read_verified(fs, p.directory, ADAPTER_FILE, p.manifest)))
    try:
        lora.check_slot_adapter(model, tensors, rank)
    except ValueError as exc:
        raise Unfit(f"{p.directory}: {exc}") from exc
    config = read_verified(fs, p.directory, ADAPTER_CONFIG, p.manifest)
    return Adapter(p.version, tensors, scaling(config), p.directory)


def _load(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)
