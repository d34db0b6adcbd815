"""The `toyalgos` algorithm package for the tests (tests/plugins/pkg/toyalgos): the dist-info that registers its
entry points, as `pip install toyalgos` would leave it. Entries are given per entry-point group, so other
extension points of the same package (e.g. `rollflow.losses`) can be registered beside the estimators."""

from __future__ import annotations

from pathlib import Path

from config.registry import ADVANTAGE_GROUP, LOSS_GROUP

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tests" / "plugins" / "pkg"
ENTRIES: dict[str, list[str]] = {
    ADVANTAGE_GROUP: ["rank = toyalgos:RANK", "short = toyalgos:SHORT"],
    LOSS_GROUP: ["sign = toyalgos.losses:SIGN"],
}


def write_site(d: Path, entries: dict[str, list[str]] | None = None) -> Path:
    """`d` holding `toyalgos-0.1.dist-info` with `entries` ({group: ["name = module:attribute", ...]}; default
    ENTRIES) as its entry_points.txt."""
    info = d / "toyalgos-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyalgos\nVersion: 0.1\n")
    groups = ENTRIES if entries is None else entries
    text = "".join(f"[{group}]\n" + "".join(f"{line}\n" for line in lines) + "\n" for group, lines in groups.items())
    (info / "entry_points.txt").write_text(text)
    return d
