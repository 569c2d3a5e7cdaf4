"""Scoring rules and the statistics used to compare policies.

Scores lie in [0, 1] per prompt (tables show them x 100):

* ``digits`` (needle-in-a-haystack): 1 if the expected number appears in the answer as a whole number
  (not inside a longer run of digits: "74810" does not count for 7481), else 0;
* ``all`` (RULER's ``string_match_all``, used for NIAH, variable tracking, common words): the fraction
  of the references found in the answer, case-insensitive substring match;
* ``part`` (RULER's ``string_match_part``, used for QA): 1 if any reference is found in the answer.

Comparisons between two policies are paired (same prompts): the mean difference with a paired
bootstrap 95% interval and the exact two-sided sign test over the prompts where they differ. A
difference is called within noise unless the interval excludes 0 and the sign test gives p < 0.05.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

METRICS = ("digits", "all", "part")


def clean_prediction(text: str) -> str:
    """RULER's post-processing: control characters become newlines, then strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text).strip()


def digits_match(prediction: str, number: str) -> float:
    """1.0 if ``number`` appears in ``prediction`` not adjacent to other digits."""
    return 1.0 if re.search(rf"(?<!\d){re.escape(number)}(?!\d)", prediction) else 0.0


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` contained in ``prediction`` (case-insensitive)."""
    pred = prediction.lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference is contained in ``prediction`` (case-insensitive)."""
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


def score(metric: str, prediction: str, references: Sequence[str]) -> float:
    """Score one answer with the task's metric (see the module docstring)."""
    if not references:
        raise ValueError("score: no reference answers")
    prediction = clean_prediction(prediction)
    if metric == "digits":
        return min(digits_match(prediction, r) for r in references)
    if metric == "all":
        return string_match_all(prediction, references)
    if metric == "part":
        return string_match_part(prediction, references)
    raise ValueError(f"score: unknown metric {metric!r}; choose one of {', '.join(METRICS)}")


def mean_ci(values: Sequence[float], seed: int = 0, resamples: int = 2000) -> tuple[float, float, float]:
    """Mean and a bootstrap 95% percentile interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    boot = np.random.default_rng(seed).choice(x, size=(resamples, x.size), replace=True).mean(axis=1)
    return float(x.mean()), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided binomial sign-test p-value for ``wins`` vs ``losses`` (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparison(variant: Sequence[float], base: Sequence[float], seed: int = 0) -> dict:
    """Paired comparison of per-prompt scores of a variant and its base (same prompts, same order)."""
    v = np.asarray(variant, dtype=np.float64)
    b = np.asarray(base, dtype=np.float64)
    if v.shape != b.shape:
        raise ValueError(f"paired_comparison: {v.shape} and {b.shape} scores are not paired")
    diff = v - b
    mean, lo, hi = mean_ci(diff, seed)
    wins, losses = int((diff > 0).sum()), int((diff < 0).sum())
    return {
        "n": int(diff.size),
        "mean_diff": mean,
        "ci95": [lo, hi],
        "wins": wins,
        "losses": losses,
        "ties": int(diff.size - wins - losses),
        "sign_test_p": sign_test(wins, losses),
        "within_noise": bool(diff.size == 0 or lo <= 0.0 <= hi or sign_test(wins, losses) >= 0.05),
    }
