"""Delta encoding of a weight publication against the previous one, with exact reconstruction.

Per tensor, against the base publication's tensor of the same name, dtype and shape:
- `same`: byte-identical, nothing stored (frozen or untouched parameters);
- `xor`: the XOR of the two tensors' raw bytes, byte-shuffled (all first bytes of each element, then
  all second bytes, ...) and zstd-compressed. Small optimizer updates leave sign, exponent and high
  mantissa bits unchanged, so those byte planes are mostly zero and compress well; XOR is exact for
  any dtype, where a float subtraction would round;
- `raw`: the tensor's bytes as they are (new or reshaped tensors, or when `xor` would not be smaller).

The payload is one safetensors file of uint8 tensors (one per changed tensor); the per-tensor
encodings travel in its metadata. `decode` rebuilds the exact tensors; the publisher records the
sha256 of the full safetensors serialization and the loader checks the rebuilt one against it.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import torch

CODEC = "zstd"
META_KEY = "rollflow.delta"


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array (bf16 included, which numpy has no dtype for)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def _shuffle(b: np.ndarray, itemsize: int) -> np.ndarray:
    return b.reshape(-1, itemsize).T.copy().reshape(-1) if itemsize > 1 else b


def _unshuffle(b: np.ndarray, itemsize: int) -> np.ndarray:
    return b.reshape(itemsize, -1).T.copy().reshape(-1) if itemsize > 1 else b


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def encode(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, int]]:
    """Encode `new` against `base` -> (payload bytes, counts of each encoding)."""
    from safetensors.torch import save

    payload: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}
    counts = {"same": 0, "xor": 0, "raw": 0}
    for name, t in new.items():
        entry: dict = {"dtype": _dtype_name(t), "shape": list(t.shape)}
        cur = raw_bytes(t)
        old = base.get(name)
        if old is not None and old.dtype == t.dtype and tuple(old.shape) == tuple(t.shape):
            prev = raw_bytes(old)
            if np.array_equal(prev, cur):
                entry["enc"] = "same"
            else:
                packed = pa.compress(_shuffle(np.bitwise_xor(prev, cur), t.element_size()), codec=CODEC, asbytes=True)
                if len(packed) < cur.nbytes:
                    entry.update(enc="xor", n=int(cur.nbytes))
                    payload[name] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
        if "enc" not in entry:
            entry["enc"] = "raw"
            payload[name] = torch.from_numpy(cur.copy())
        counts[entry["enc"]] += 1
        meta[name] = entry
    return save(payload, metadata={META_KEY: json.dumps(meta, sort_keys=True)}), counts


def decode(base: dict[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    """Rebuild the exact tensors from a base and an `encode` payload. Raises ValueError when the payload
    needs a base tensor that `base` lacks or that has another dtype or shape."""
    from safetensors.torch import load

    meta = _payload_meta(payload)
    stored = load(payload)
    out: dict[str, torch.Tensor] = {}
    for name, entry in meta.items():
        dtype = getattr(torch, entry["dtype"])
        shape = tuple(entry["shape"])
        if entry["enc"] == "raw":
            out[name] = stored[name].view(dtype).reshape(shape).clone()
            continue
        old = base.get(name)
        if old is None or old.dtype != dtype or tuple(old.shape) != shape:
            raise ValueError(
                f"delta for tensor {name!r} needs a base tensor {entry['dtype']}{list(shape)}; the base has none"
            )
        if entry["enc"] == "same":
            out[name] = old
            continue
        packed = stored[name].numpy()
        xored = _unshuffle(
            np.frombuffer(pa.decompress(packed, decompressed_size=entry["n"], codec=CODEC, asbytes=True), np.uint8),
            old.element_size(),
        )
        data = np.bitwise_xor(raw_bytes(old), xored)
        out[name] = torch.from_numpy(data).view(dtype).reshape(shape)
    return out


def _payload_meta(payload: bytes) -> dict[str, dict]:
    """The per-tensor encodings stored in a payload's safetensors header metadata."""
    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_len])
    meta = (header.get("__metadata__") or {}).get(META_KEY)
    if meta is None:
        raise ValueError(f"not a delta payload: no {META_KEY!r} metadata")
    return json.loads(meta)
