"""Weight publications: `OUTPUT_DIR/weights/step=NNNNNN/` + a manifest written last.

Version N is the policy after trainer step N (version 0 = initial weights, after the warm-up). The
trainer publishes, the orchestrator discovers new versions and tells the inference engine to load them.

A publication is either full (`model.safetensors`) or, with `storage.weights_delta`, a delta
(`model.delta.safetensors`, see storage/delta.py) against an earlier publication named in the manifest
as `base_version`; every `storage.weights_full_every`-th version, and the first one a process
publishes, is full. Both kinds record `model_sha256`, the sha256 of the full safetensors serialization,
and the loader checks a rebuilt delta against it, so reconstruction is exact or it fails loudly.
`full_bytes` and `payload_bytes` in the manifest give the payload ratio.

Next to the weights, a publication carries the files that make it a Hugging Face model directory
(config.json, generation_config.json, tokenizer files: engines/models/modeldir.py builds them), committed
in the same manifest, so a full publication loads with `AutoModelForCausalLM.from_pretrained`. A delta
publication holds no model.safetensors: `export_hf` writes a loadable copy of any publication.

With `[model.lora]` the trainer publishes adapters (`encoding: "lora"`, storage/lora.py's PEFT layout):
the manifest's `lora_base` names the full publication the adapter applies to (`path` relative to the
output root, and that publication's `model_sha256`, checked on load), `base_version` keeps it from
retention, `payload_bytes` is the adapter's size and `full_bytes` the base's. `load` returns base and
adapter tensors together (the adapted model's state dict); `export_hf` writes them merged.
"""

from __future__ import annotations

import fsspec

from storage.fs import (
    MANIFEST,
    MANIFEST_CHECKSUM,
    CorruptError,
    commit_dir,
    fs_settings,
    is_committed,
    join,
    local_path,
    newest_committed_step,
    read_manifest,
    read_verified,
    sha256,
    step_dir,
)

WEIGHTS_FILE = "model.safetensors"
DELTA_FILE = "model.delta.safetensors"


def weights_root(output_root: str) -> str:
    return join(output_root, "weights")


def version_dir(output_root: str, version: int) -> str:
    return step_dir(weights_root(output_root), version)


def _sibling(directory: str, version: int) -> str:
    """`.../weights/step=B` next to `.../weights/step=N` (delta bases live in the same folder)."""
    return step_dir(directory.rstrip("/").rsplit("/", 1)[0], version)


class Publisher:
    """The writer's side (one per publishing process): commits versions, keeping the last one as the base
    of the next delta (with `storage.weights_delta`, from the settings `fs` carries), and what each
    committed version was rebuilt from (`bases`, for retention's delta-chain closure)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_root: str):
        self.fs, self.root = fs, output_root
        self.settings = fs_settings(fs)
        self.last: tuple[int, dict] | None = None  # (version, tensors) of the last publication, delta mode only
        self.bases: dict[int, int | None] = {}

    def publish(self, version: int, state_dict: dict, files: dict[str, bytes] | None = None) -> str:
        """Serialize and commit a state dict as policy `version`, with `files` (config.json, tokenizer files)
        in the same commit; returns the publication's directory."""
        from safetensors.torch import save

        s = self.settings
        tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
        full = save(tensors)
        directory = version_dir(self.root, version)
        meta = {"version": version, "model_sha256": sha256(full), "full_bytes": len(full)}
        base = self.last if s.weights_delta else None
        if base is not None and base[0] < version and version % s.weights_full_every != 0:
            from storage import delta

            payload, counts = delta.encode(base[1], tensors)
            meta.update(encoding="delta", base_version=base[0], payload_bytes=len(payload), tensors=counts)
            commit_dir(self.fs, directory, {DELTA_FILE: payload, **(files or {})}, meta)
        else:
            meta.update(encoding="full", payload_bytes=len(full))
            digests = {WEIGHTS_FILE: str(meta["model_sha256"])}
            commit_dir(self.fs, directory, {WEIGHTS_FILE: full, **(files or {})}, meta, digests=digests)
        if s.weights_delta:
            self.last = (version, {k: v.clone() for k, v in tensors.items()})  # params change in place
        self.bases[version] = base[0] if meta["encoding"] == "delta" and base else None
        return directory

    def publish_adapter(
        self,
        version: int,
        adapters: dict,
        adapter_config: bytes,
        base_version: int,
        files: dict[str, bytes] | None = None,
        merged: dict | None = None,
    ) -> str:
        """Commit LoRA `adapters` (model names) as policy `version`, applying to full publication
        `base_version`; with `merged`, the merged weights go into the same commit as model.safetensors."""
        from safetensors.torch import save

        from storage.lora import ADAPTER_CONFIG, ADAPTER_FILE, to_peft

        base_dir = version_dir(self.root, base_version)
        base = read_manifest(self.fs, base_dir)
        if base.get("encoding") != "full":
            raise ValueError(f"{base_dir}: a LoRA base must be a full publication, not {base.get('encoding')!r}")
        payload = save({k: v.detach().contiguous().cpu() for k, v in to_peft(adapters).items()})
        out = {ADAPTER_FILE: payload, ADAPTER_CONFIG: adapter_config, **(files or {})}
        if merged is not None:
            out[WEIGHTS_FILE] = save({k: v.detach().contiguous().cpu() for k, v in merged.items()})
        ref = {
            "version": base_version,
            "path": base_dir[len(self.root) :].lstrip("/"),
            "model_sha256": base["model_sha256"],
        }
        meta = {
            "version": version,
            "encoding": "lora",
            "lora_base": ref,
            "base_version": base_version,
            "payload_bytes": len(payload),
            "full_bytes": base["full_bytes"],
        }
        directory = version_dir(self.root, version)
        commit_dir(self.fs, directory, out, meta)
        self.bases[version] = base_version
        return directory


def publish(
    fs: fsspec.AbstractFileSystem,
    output_root: str,
    version: int,
    state_dict: dict,
    files: dict[str, bytes] | None = None,
) -> str:
    """A one-off full publication (no delta base to keep): the warm-up's version 0, a resume's repair."""
    return Publisher(fs, output_root).publish(version, state_dict, files)


def latest_version(fs: fsspec.AbstractFileSystem, output_root: str) -> int | None:
    """The newest committed publication; cheap enough to poll."""
    return newest_committed_step(fs, weights_root(output_root))


def is_published(fs: fsspec.AbstractFileSystem, output_root: str, version: int) -> bool:
    return is_committed(fs, version_dir(output_root, version))


def read_version(fs: fsspec.AbstractFileSystem, directory: str) -> int:
    """The policy version a committed publication declares in its manifest."""
    return int(read_manifest(fs, directory)["version"])


def load(fs: fsspec.AbstractFileSystem, directory: str, cache: dict[str, dict] | None = None) -> dict:
    """Load a committed publication (checksum-verified; a delta is rebuilt from its base chain and checked
    against `model_sha256`) as a CPU state dict. Callers must not modify the tensors in place. A reader
    that follows versions in order passes its own `cache` (the last two loaded), so a delta's base is not
    rebuilt each time."""
    return _load(fs, directory.rstrip("/"), {} if cache is None else cache, from_cache=False)


def _load(fs: fsspec.AbstractFileSystem, directory: str, cache: dict[str, dict], from_cache: bool) -> dict:
    # The publication asked for is always read and verified; only delta bases, verified when they were
    # loaded, may come from the cache (an engine following versions in order rebuilds from the last one).
    from safetensors.torch import load as st_load
    from safetensors.torch import save

    manifest = read_manifest(fs, directory)
    key = f"{directory}#{manifest.get('model_sha256') or manifest.get(MANIFEST_CHECKSUM)}"  # a rewrite misses
    if from_cache and key in cache:
        return dict(cache[key])
    if manifest.get("encoding") == "lora":
        state = _load_adapter(fs, directory, manifest, cache)
    elif manifest.get("encoding") != "delta":
        state = st_load(read_verified(fs, directory, WEIGHTS_FILE, manifest))
    else:
        from storage import delta

        payload = read_verified(fs, directory, DELTA_FILE, manifest)
        base_dir = _sibling(directory, int(manifest["base_version"]))
        try:
            state = delta.decode(_load(fs, base_dir, cache, from_cache=True), payload)
        except (ValueError, FileNotFoundError) as exc:
            raise CorruptError(f"{directory}: cannot rebuild from its base {base_dir}: {exc}") from exc
        if sha256(save(state)) != manifest["model_sha256"]:
            raise CorruptError(
                f"{directory}/{DELTA_FILE}: rebuilt weights do not match model_sha256 in the manifest "
                f"(base {base_dir}); the delta or its base is corrupted"
            )
    plain = [k for k in cache if not k.startswith("lora-base:")]  # a LoRA base stays: every adapter needs it
    if len(plain) >= 2:
        cache.pop(plain[0])
    cache[key] = state
    return dict(state)


def _load_adapter(fs: fsspec.AbstractFileSystem, directory: str, manifest: dict, cache: dict[str, dict]) -> dict:
    """Base (the full publication `lora_base` names, its sha256 checked) + adapter tensors, model names.
    The base stays cached under its own key, so following adapter versions reads only the adapters."""
    from safetensors.torch import load as st_load

    from storage.lora import ADAPTER_FILE, from_peft

    ref = manifest["lora_base"]
    base_dir = _sibling(directory, int(ref["version"]))
    key = f"lora-base:{base_dir}#{ref['model_sha256']}"
    if key not in cache:
        base_manifest = read_manifest(fs, base_dir)
        if base_manifest.get("model_sha256") != ref["model_sha256"]:
            raise CorruptError(
                f"{directory}: its LoRA base {base_dir} has model_sha256 {base_manifest.get('model_sha256')}, "
                f"not the {ref['model_sha256']} the adapter was trained on"
            )
        cache[key] = _load(fs, base_dir, {}, from_cache=False)
    try:
        adapters = from_peft(st_load(read_verified(fs, directory, ADAPTER_FILE, manifest)))
    except ValueError as exc:
        raise CorruptError(f"{directory}/{ADAPTER_FILE}: {exc}") from exc
    return {**cache[key], **adapters}


def load_latest(fs: fsspec.AbstractFileSystem, output_root: str) -> tuple[int, dict] | None:
    """(version, state dict) of the newest committed publication, or None when there is none."""
    version = latest_version(fs, output_root)
    if version is None:
        return None
    return version, load(fs, version_dir(output_root, version))


def extra_files(fs: fsspec.AbstractFileSystem, directory: str) -> dict[str, bytes]:
    """The checksum-verified files of a publication besides its weights (config.json, tokenizer, ...)."""
    manifest = read_manifest(fs, directory)
    skip = (WEIGHTS_FILE, DELTA_FILE, "adapter_model.safetensors", "adapter/adapter_model.safetensors")
    names = [n for n in manifest.get("files", {}) if n not in skip]
    return {n: read_verified(fs, directory, n, manifest) for n in names}


def export_hf(fs: fsspec.AbstractFileSystem, directory: str, dest: str) -> None:
    """Write publication `directory` (full or delta) as a plain Hugging Face directory at local `dest`."""
    import os

    from safetensors.torch import save_file

    from storage.lora import ADAPTER_CONFIG, is_adapter_key, merge, scaling

    os.makedirs(dest, exist_ok=True)
    state, files = load(fs, directory), extra_files(fs, directory)
    if ADAPTER_CONFIG in files:  # an adapter publication: its base with the adapter folded in
        scale = scaling(files.pop(ADAPTER_CONFIG))  # transformers would take a directory with one for a PEFT adapter
        base = {k: v for k, v in state.items() if not is_adapter_key(k)}
        state = merge(base, {k: v for k, v in state.items() if is_adapter_key(k)}, scale)
    save_file(state, os.path.join(dest, WEIGHTS_FILE), metadata={"format": "pt"})
    where = join(directory, MANIFEST)
    for name, data in files.items():
        path = local_path(dest, name, where)  # a manifest's names stay inside `dest`
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
