"""Delta weight publications: exact reconstruction, checksum verification, payload ratio, chains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config.storage import StorageConfig
from storage import delta, weights
from storage.fs import CorruptError, get_fs, read_manifest


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Successive 'policies': AdamW-sized updates on most tensors, one frozen, one bf16."""
    g = torch.Generator().manual_seed(seed)
    cur = {
        "embed.weight": torch.randn(64, 32, generator=g) * 0.02,
        "mlp.weight": torch.randn(32, 32, generator=g) * 0.02,
        "norm.weight": torch.ones(32),
        "frozen.weight": torch.randn(16, 8, generator=g),
        "half.weight": (torch.randn(8, 8, generator=g) * 0.02).to(torch.bfloat16),
    }
    out = [cur]
    for _ in range(n - 1):
        nxt = {k: v.clone() for k, v in cur.items()}
        for k in ("embed.weight", "mlp.weight", "norm.weight", "half.weight"):
            nxt[k] = nxt[k] + (torch.randn(nxt[k].shape, generator=g) * 1e-3).to(nxt[k].dtype)
        out.append(nxt)
        cur = nxt
    return out


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k  # bit-exact, NaNs included


def test_encode_decode_is_bit_exact_and_smaller():
    s0, s1 = _states(2)
    s1["new.bias"] = torch.arange(5, dtype=torch.int64)  # not in the base: stored raw
    payload, counts = delta.encode(s0, s1)
    assert counts == {"same": 1, "xor": 4, "raw": 1}
    _equal(delta.decode(s0, payload), s1)
    full = sum(t.numel() * t.element_size() for t in s1.values())
    assert len(payload) < 0.9 * full


def test_decode_refuses_a_base_that_does_not_fit():
    s0, s1 = _states(2)
    payload, _ = delta.encode(s0, s1)
    bad = dict(s0)
    bad["mlp.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="mlp.weight"):
        delta.decode(bad, payload)


DELTA = StorageConfig(weights_delta=True, weights_full_every=4)


def _publish_all(fs, root, states) -> None:
    publisher = weights.Publisher(fs, root)  # one publisher keeps the last version as the next delta's base
    for v, sd in enumerate(states):
        publisher.publish(v, sd)


def test_delta_publications_rebuild_exactly_through_the_chain(tmp_path):
    fs, root = get_fs(str(tmp_path / "run"), DELTA)
    states = _states(7)
    _publish_all(fs, root, states)
    kinds = [read_manifest(fs, weights.version_dir(root, v))["encoding"] for v in range(7)]
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta", "delta"]
    m3 = read_manifest(fs, weights.version_dir(root, 3))
    assert m3["base_version"] == 2 and m3["payload_bytes"] < m3["full_bytes"]
    for v in (6, 3, 5, 1):  # out of order: each rebuild walks its own chain
        _equal(weights.load(fs, weights.version_dir(root, v)), states[v])
    assert weights.load_latest(fs, root)[0] == 6


def test_a_corrupted_base_fails_the_rebuild_with_its_path(tmp_path):
    fs, root = get_fs(str(tmp_path / "run"), DELTA)
    _publish_all(fs, root, _states(3))
    base = Path(weights.version_dir(root, 1)) / weights.DELTA_FILE
    data = bytearray(base.read_bytes())
    data[-3] ^= 0x40
    base.write_bytes(bytes(data))
    with pytest.raises(CorruptError, match="step=000001"):
        weights.load(fs, weights.version_dir(root, 2))


def test_a_wrong_model_checksum_is_refused(tmp_path):
    """Exactness is checked: a manifest whose model_sha256 does not match the rebuilt weights fails."""
    import json

    from storage.fs import MANIFEST, MANIFEST_CHECKSUM, _manifest_digest

    fs, root = get_fs(str(tmp_path / "run"), DELTA)
    _publish_all(fs, root, _states(2))
    path = Path(weights.version_dir(root, 1)) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["model_sha256"] = "0" * 64
    manifest[MANIFEST_CHECKSUM] = _manifest_digest(manifest)  # a consistent manifest, wrong content hash
    path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptError, match="model_sha256"):
        weights.load(fs, weights.version_dir(root, 1))
