"""Fit the built-in scorer's weights from prompts labelled with whether the small model
sufficed: logistic regression on the features Envoy computes (``signals.difficulty``).

Plain Python, no numpy: seven features and a few thousand rows make Newton's method (iteratively
reweighted least squares) an 8x8 solve per step, a fraction of a second in all. Features are
standardised for the fit and the weights mapped back, so the policy holds weights on the raw
features that Envoy's Lua computes. A small ridge keeps a feature that never varies (no row asks
for reasoning) at weight 0 instead of making the solve singular.

The labelled file is JSON Lines, one object per row: ``small_ok`` (true when the small model's
answer was good enough) and either ``request`` (the OpenAI request body as sent) or ``prompt``
(a user message). The score is the probability that the small model does *not* suffice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from policies.models.difficulty import FEATURES
from signals.difficulty import features, linear, sigmoid

RIDGE = 1e-3
"""L2 penalty on the standardised weights."""
HOLDOUT_EVERY = 5
"""Every fifth row is held out for the ROC AUC (20%), the rest fitted."""


class LabelError(ValueError):
    """A row of the labelled file is not usable; the message names its line and field."""


@dataclass(frozen=True, slots=True)
class Row:
    body: bytes
    hard: bool
    """The small model did not suffice."""


@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted weights on the raw features, and how well they rank held-out rows."""

    weights: dict[str, float]
    bias: float
    auc: float
    """ROC AUC on the held-out rows: the chance a hard row scores above an easy one."""
    trained: int
    held_out: int


def read_rows(lines: Iterable[str], model: str = "auto") -> list[Row]:
    """Rows of a labelled JSONL file; blank lines are skipped."""
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise LabelError(f"line {number}: not JSON ({error.msg})") from None
        if not isinstance(item, dict):
            raise LabelError(f"line {number}: expected an object with small_ok and a request")
        label = item.get("small_ok")
        if not isinstance(label, bool):
            raise LabelError(f"line {number}: small_ok must be true or false")
        request: Any = item.get("request")
        if request is None and isinstance(item.get("prompt"), str):
            request = {"model": model, "messages": [{"role": "user", "content": item["prompt"]}]}
        if not isinstance(request, dict):
            raise LabelError(f"line {number}: needs request (an object) or prompt (a string)")
        rows.append(Row(json.dumps(request).encode(), hard=not label))
    return rows


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the matrix is small and positive definite)."""
    n = len(vector)
    a = [[*row, vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= factor * a[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


def logistic_regression(
    x: Sequence[Sequence[float]], y: Sequence[bool], *, iterations: int = 25
) -> list[float]:
    """Coefficients (intercept first) of a ridge logistic regression by Newton's method."""
    k = len(x[0]) + 1
    beta = [0.0] * k
    for _ in range(iterations):
        hessian = [[RIDGE if i == j and i else 0.0 for j in range(k)] for i in range(k)]
        gradient = [-RIDGE * beta[i] if i else 0.0 for i in range(k)]
        for row, label in zip(x, y, strict=True):
            z = [1.0, *row]
            p = sigmoid(sum(b * v for b, v in zip(beta, z, strict=True)))
            w = max(p * (1 - p), 1e-9)
            error = (1.0 if label else 0.0) - p
            for i in range(k):
                gradient[i] += error * z[i]
                zi = w * z[i]
                for j in range(i, k):
                    hessian[i][j] += zi * z[j]
        for i in range(k):
            for j in range(i):
                hessian[i][j] = hessian[j][i]
        step = _solve(hessian, gradient)
        beta = [b + s for b, s in zip(beta, step, strict=True)]
        if max(abs(s) for s in step) < 1e-8:
            break
    return beta


def roc_auc(scores: Sequence[float], hard: Sequence[bool]) -> float:
    """Area under the ROC curve by ranks (ties count half); 0.5 when one class is missing."""
    pairs = sorted(zip(scores, hard, strict=True))
    positives = sum(hard)
    negatives = len(hard) - positives
    if not positives or not negatives:
        return 0.5
    rank_sum = 0.0
    i = 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        average = (i + j + 1) / 2  # ranks i+1 .. j
        rank_sum += average * sum(1 for _, label in pairs[i:j] if label)
        i = j
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def fit(rows: Sequence[Row]) -> Fit:
    """Fit on four rows in five, report the ROC AUC on the fifth."""
    if len(rows) < 10:
        raise LabelError(f"{len(rows)} labelled rows; at least 10 are needed")
    values = [[features(row.body)[name] for name in FEATURES] for row in rows]
    train = [i for i in range(len(rows)) if i % HOLDOUT_EVERY]
    test = [i for i in range(len(rows)) if not i % HOLDOUT_EVERY]
    if len({rows[i].hard for i in train}) < 2:
        raise LabelError("the rows need both labels: some where small_ok is true, some false")
    means = [sum(values[i][f] for i in train) / len(train) for f in range(len(FEATURES))]
    spreads = [
        math.sqrt(sum((values[i][f] - means[f]) ** 2 for i in train) / len(train)) or 1.0
        for f in range(len(FEATURES))
    ]
    standard = [
        [(values[i][f] - means[f]) / spreads[f] for f in range(len(FEATURES))] for i in train
    ]
    beta = logistic_regression(standard, [rows[i].hard for i in train])
    weights = {name: beta[f + 1] / spreads[f] for f, name in enumerate(FEATURES)}
    bias = beta[0] - sum(weights[name] * means[f] for f, name in enumerate(FEATURES))
    weights = {name: round(value, 6) for name, value in weights.items()}
    bias = round(bias, 6)
    held = [
        sigmoid(linear(weights, bias, dict(zip(FEATURES, values[i], strict=True)))) for i in test
    ]
    return Fit(
        weights=weights,
        bias=bias,
        auc=roc_auc(held, [rows[i].hard for i in test]),
        trained=len(train),
        held_out=len(test),
    )
