"""Which config changes a resumed run may make."""

from __future__ import annotations

# Changing these mid-run would mix incompatible data in one run: other weights shapes, other prompts
# or token ids, another group structure. Everything else (learning rate, max_steps, ...) may change.
INCOMPATIBLE_ON_RESUME = ("model", "envs", "seed", "orchestrator.group_size", "sft")


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_changes(old: dict, new: dict) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(incompatible, compatible) differences between a stored run config and a resume's config,
    each as {dotted key: (old, new)}."""
    a, b = _flatten(old), _flatten(new)
    changed = {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}
    changed.pop("inference.port", None)  # stored as picked at launch; each attempt picks again
    bad = {k: v for k, v in changed.items() if any(k == p or k.startswith(p + ".") for p in INCOMPATIBLE_ON_RESUME)}
    return bad, {k: v for k, v in changed.items() if k not in bad}
