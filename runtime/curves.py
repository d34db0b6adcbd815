"""A run's curves for people to read: the reward curve and the held-out evaluation curves of its metrics
rows, as bounded markdown tables and unicode sparklines (Prefect's markdown artifacts render text, no images).

metrics rows --metric_curve / eval_curve_keys (storage/metrics.py)--> {name: [(step, value)]}
  --> sparkline_block: one line per curve, values scaled between the curve's min and max
  --> curves_table:    one row per step, downsampled to at most MAX_ROWS evenly spaced steps (first and last
                       kept; each row shows that step's own values, nothing is averaged)
Pure (no I/O): the end-of-run summary (summary.py) and the live progress view (progress.py) use it.
"""

from __future__ import annotations

from itertools import pairwise

from storage.metrics import eval_curve_keys, metric_curve

BARS = "▁▂▃▄▅▆▇█"
MAX_ROWS = 50
SPARK_WIDTH = 60

Curve = list[tuple[int, float]]


def run_curves(rows: list[dict], key: str = "reward_mean") -> dict[str, Curve]:
    """The training curve `key` and every held-out evaluation curve present, empty ones left out."""
    curves = {name: metric_curve(rows, name) for name in [key, *eval_curve_keys(rows)]}
    return {name: c for name, c in curves.items() if c}


def downsample(points: list, max_points: int = MAX_ROWS) -> list:
    """At most `max_points` evenly spaced items of `points`, the first and the last always among them."""
    n = len(points)
    if n <= max_points:
        return list(points)
    if max_points < 2:
        raise ValueError(f"downsample: max_points must be >= 2 to keep the first and last, got {max_points}")
    return [points[round(i * (n - 1) / (max_points - 1))] for i in range(max_points)]


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """One block character per value (per bucket mean when there are more values than `width`), from the
    lowest bar at the minimum to the highest at the maximum; a flat curve is drawn at mid height."""
    n = len(values)
    if n > width:
        bounds = [i * n // width for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in pairwise(bounds)]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi == lo:
        return BARS[len(BARS) // 2 - 1] * len(values)
    top = len(BARS) - 1
    return "".join(BARS[round((v - lo) / (hi - lo) * top)] for v in values)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def sparkline_block(curves: dict[str, Curve]) -> str:
    """A fenced text block, one line per curve: name, sparkline, first -> last, range and steps."""
    width = max((len(name) for name in curves), default=0)
    lines = []
    for name, c in curves.items():
        values = [v for _, v in c]
        lines.append(
            f"{name.ljust(width)}  {sparkline(values)}  {_fmt(values[0])} -> {_fmt(values[-1])} "
            f"(min {_fmt(min(values))}, max {_fmt(max(values))}; steps {c[0][0]}..{c[-1][0]}, {len(c)} points)"
        )
    return "\n".join(["```text", *lines, "```"])


def curves_table(curves: dict[str, Curve], max_rows: int = MAX_ROWS) -> str:
    """A markdown table: a `step` column and one column per curve ("-" where a curve has no value at that
    step), over at most `max_rows` evenly spaced steps of the union of the curves' steps."""
    by_step: dict[int, dict[str, float]] = {}
    for name, c in curves.items():
        for step, v in c:
            by_step.setdefault(step, {})[name] = v
    names = list(curves)
    lines = ["| step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for step in downsample(sorted(by_step), max_rows):
        lines.append(f"| {step} | " + " | ".join(_fmt(by_step[step].get(n)) for n in names) + " |")
    return "\n".join(lines)


def curves_markdown(rows: list[dict], key: str = "reward_mean", max_rows: int = MAX_ROWS) -> str:
    """The curves section of a summary: sparklines, then the training curve's table and the held-out
    evaluation table (each downsampled); empty when the rows hold no curve."""
    curves = run_curves(rows, key)
    if not curves:
        return ""
    train = {k: c for k, c in curves.items() if k == key}
    held_out = {k: c for k, c in curves.items() if k != key}
    parts = ["## Curves", "", sparkline_block(curves)]
    for title, group in ((f"{key} by step", train), ("held-out evaluation by step", held_out)):
        if group:
            steps = len({s for c in group.values() for s, _ in c})
            shown = f" ({min(steps, max_rows)} of {steps} steps, evenly spaced)" if steps > max_rows else ""
            parts += ["", f"### {title}{shown}", "", curves_table(group, max_rows)]
    return "\n".join(parts)
