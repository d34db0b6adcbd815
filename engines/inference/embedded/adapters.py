"""A tenant's adapter publications as the shared server reads them (docs/multitenant.md).

A tenant run publishes into its own OUTPUT_DIR: version 0 is its copy of the deployment's backbone (a full
publication whose model_sha256 is the backbone's), every later version an adapter publication (storage/weights.py
`encoding: "lora"`) whose `lora_base.model_sha256` names the base it was trained on. The shared server reads only
the adapter file (PEFT names -> model names, storage/lora.py) and its scaling, never the tenant's base copy: the
base is the backbone it already serves, which the sha256 check proves. `Unfit` is a publication this deployment can
never serve (another base, a rank over max_lora_rank, a layer the backbone lacks): the tenant is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec
import torch

from engines.models import lora
from storage import weights
from storage.fs import is_committed, read_manifest, read_verified
from storage.lora import ADAPTER_CONFIG, ADAPTER_FILE, from_peft, scaling


class Unfit(ValueError):
    """A publication this shared deployment cannot serve; the message says why."""


class NotPublished(LookupError):
    """No committed publication (at that version) in the tenant's OUTPUT_DIR yet."""


@dataclass
class Adapter:
    version: int
    tensors: dict[str, torch.Tensor]  # model names; empty: the backbone itself (version 0)
    scaling: float
    directory: str


def read_adapter(fs: fsspec.AbstractFileSystem, root: str, version: int | None, model, backbone: str, rank: int):
    """Publication `version` (None: the newest committed) of the tenant run at `root`, checked against the served
    `model`'s slots: its base must be the backbone (model_sha256 `backbone`), its rank at most `rank`."""
    if version is None:
        version = weights.latest_version(fs, root)
        if version is None:
            raise NotPublished(f"no committed publication under {weights.weights_root(root)} yet")
    directory = weights.version_dir(root, version)
    if not is_committed(fs, directory):
        raise NotPublished(f"no committed publication at {directory}")
    manifest = read_manifest(fs, directory)
    served = int(manifest["version"])
    if manifest.get("encoding") != "lora":
        if manifest.get("model_sha256") != backbone:
            raise Unfit(
                f"{directory}: a full publication whose model_sha256 {manifest.get('model_sha256')} is not the "
                f"deployment's backbone {backbone} (a tenant publishes LoRA adapters on the backbone)"
            )
        return Adapter(served, {}, 0.0, directory)
    base = manifest["lora_base"]["model_sha256"]
    if base != backbone:
        raise Unfit(f"{directory}: its adapter applies to base model_sha256 {base}, not this deployment's {backbone}")
    tensors = from_peft(_load(read_verified(fs, directory, ADAPTER_FILE, manifest)))
    try:
        lora.check_slot_adapter(model, tensors, rank)
    except ValueError as exc:
        raise Unfit(f"{directory}: {exc}") from exc
    return Adapter(served, tensors, scaling(read_verified(fs, directory, ADAPTER_CONFIG, manifest)), directory)


def _load(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)
