"""Evaluation metrics from per-sample rewards, pure Python: mean reward, avg@n, pass@k (the unbiased estimator
of Chen et al. 2021) and 95% confidence intervals over tasks. docs/evaluation.md defines each.

    rows (env, task_index, reward, correct) -> per environment: per-task values -> means and intervals
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct, is correct)
    = 1 - C(n-c, k) / C(n, k), as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the
    binomials (they overflow floats from n ~ 1030)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def normal_ci(values: Sequence[float]) -> tuple[float, float] | None:
    """The 95% normal interval of the mean of `values` (one per task): mean +- z * s / sqrt(T), s the sample
    standard deviation (T - 1 in the denominator); None with fewer than two tasks."""
    t = len(values)
    if t < 2:
        return None
    mean = sum(values) / t
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (t - 1))
    half = Z95 * s / math.sqrt(t)
    return (mean - half, mean + half)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def env_metrics(tasks: dict[int, list[tuple[float, bool]]], ks: Iterable[int]) -> dict:
    """One environment's metrics from task index -> its samples' (reward, correct)."""
    rewards = [_mean([r for r, _ in samples]) for samples in tasks.values()]
    n = min(len(s) for s in tasks.values())
    out: dict = {
        "tasks": len(tasks),
        "samples": sum(len(s) for s in tasks.values()),
        "reward_mean": _mean(rewards),
        "reward_ci95": normal_ci(rewards),
        f"avg@{n}": _mean(rewards),
        "correct_fraction": _mean([_mean([float(c) for _, c in s]) for s in tasks.values()]),
    }
    for k in ks:
        per_task = [pass_at_k(len(s), sum(c for _, c in s), k) for s in tasks.values()]
        out[f"pass@{k}"] = _mean(per_task)
        out[f"pass@{k}_ci95"] = normal_ci(per_task)
    return out


def summarize(rows: Iterable[tuple[str, int, float, bool]], envs: Sequence[str], ks: Iterable[int]) -> dict:
    """Per environment (in `envs` order) and overall (`reward_mean`: the mean of the environments' means)."""
    by_env: dict[str, dict[int, list[tuple[float, bool]]]] = defaultdict(lambda: defaultdict(list))
    for env, task, reward, correct in rows:
        by_env[env][task].append((reward, correct))
    ks = list(ks)
    per_env = {env: env_metrics(by_env[env], ks) for env in envs if by_env.get(env)}
    means = [m["reward_mean"] for m in per_env.values()]
    out = {"reward_mean": _mean(means) if means else None, "envs": per_env}
    return {**out, "metrics": metric_keys(out, ks)}


def metric_keys(summary: dict, ks: Iterable[int]) -> dict[str, float]:
    """The flat keys the trainer merges into metrics.jsonl and MLflow (a summary's `metrics`):
    `eval/reward_mean`, `eval/<env>/reward_mean`, `eval/<env>/pass@<k>`."""
    out: dict[str, float] = {}
    if summary.get("reward_mean") is not None:
        out["eval/reward_mean"] = summary["reward_mean"]
    for env, m in summary.get("envs", {}).items():
        out[f"eval/{env}/reward_mean"] = m["reward_mean"]
        out |= {f"eval/{env}/pass@{k}": m[f"pass@{k}"] for k in ks if f"pass@{k}" in m}
    return out


def task_means(rows: Iterable[tuple[str, int, float]]) -> dict[tuple[str, int], float]:
    """(env, task_index) -> the task's mean reward over its samples."""
    sums: dict[tuple[str, int], list[float]] = defaultdict(list)
    for env, task, reward in rows:
        sums[(env, task)].append(reward)
    return {key: _mean(values) for key, values in sums.items()}


def paired_difference(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]) -> dict:
    """Per environment and over all: the mean of `after - before` over the tasks both evaluated, with its 95%
    normal interval. Pairing by task removes the spread between tasks, so a change is told from noise with
    fewer tasks than two separate intervals need."""
    shared = sorted(set(before) & set(after))
    if not shared:
        raise ValueError("the two evaluations share no (env, task) pair: compare evaluations of the same tasks")
    out: dict = {}
    for env in [*sorted({e for e, _ in shared}), None]:
        diffs = [after[k] - before[k] for k in shared if env is None or k[0] == env]
        out[env or "all"] = {"tasks": len(diffs), "difference": _mean(diffs), "ci95": normal_ci(diffs)}
    return out
