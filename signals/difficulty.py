"""The built-in difficulty scorer, in Python: the same features and score that Envoy's Lua
filter computes from a request body (``xdsserver.translate.difficulty``), for fitting weights
from labelled prompts, for benchmarks, and to check the two agree.

Features are read from the raw JSON body as sent, not from a parsed document, because that is
what Envoy sees: Lua has no JSON parser worth its cost per request, and plain substring counts
over the body are cheap in both languages and give the same numbers in both. Counts look at
the first ``WINDOW`` bytes only, so a long document costs no more than a short one; its length
still counts in ``promptTokens``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from policies.models.difficulty import FEATURES

WINDOW = 16384
"""Bytes of the body that word and symbol counts look at."""
COUNT_LIMIT = 20
"""Largest value of a count feature: past it, more of the same says little more."""
MATH_WORDS = ("integral", "derivative", "equation", "prove", "theorem", "matrix", "probability")
QUESTION_WORDS = ("why", "how", "explain", "compare", "analy", "design", "derive", "optimi")
EFFORTS = {"low": 1.0, "medium": 2.0, "high": 3.0}

_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"[ \t\n\r\f\v]*:[ \t\n\r\f\v]*([0-9]+)')
_EFFORT = re.compile(rb'"reasoning_effort"[ \t\n\r\f\v]*:[ \t\n\r\f\v]*"([A-Za-z]+)"')


def _count(text: bytes, words: tuple[str, ...]) -> int:
    return sum(text.count(word.encode()) for word in words)


def features(body: bytes) -> dict[str, float]:
    """The built-in scorer's features of one request body (``FEATURES``, in order)."""
    head = body[:WINDOW]
    lower = head.lower()
    max_tokens = _MAX_TOKENS.search(head)
    effort = _EFFORT.search(head)
    return {
        "promptTokens": math.log(1 + len(body) / 4),
        "turns": float(min(head.count(b'"role"'), COUNT_LIMIT)),
        "codeBlocks": float(min(head.count(b"```") // 2, COUNT_LIMIT)),
        "math": float(min(head.count(b"=") + _count(lower, MATH_WORDS), COUNT_LIMIT)),
        "questionWords": float(min(_count(lower, QUESTION_WORDS), COUNT_LIMIT)),
        "maxTokens": math.log(1 + min(int(max_tokens.group(1)), 10**6)) if max_tokens else 0.0,
        "reasoningEffort": EFFORTS.get(effort.group(1).decode().lower(), 0.0) if effort else 0.0,
    }


def linear(weights: Mapping[str, float], bias: float, values: Mapping[str, float]) -> float:
    """The linear model's logit."""
    return bias + sum(weights.get(name, 0.0) * values[name] for name in FEATURES)


def sigmoid(z: float) -> float:
    """The logistic function, without overflow for large |z|."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def score(weights: Mapping[str, float], bias: float, body: bytes) -> float:
    """The built-in score of one request body, from 0 (easy) to 1 (hard)."""
    return sigmoid(linear(weights, bias, features(body)))
