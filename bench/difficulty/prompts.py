"""Prompts with a known difficulty, and what a small and a large model make of them.

Each prompt is easy or hard. Its request's features (length, conversation depth, code blocks,
math, question words, ``max_tokens``, ``reasoning_effort``) are drawn from its class's
distribution, except that each feature, with probability ``noise``, is drawn from the other
class's instead: at 0 the features give the label away, at 0.5 they say nothing. The small
model fails a hard prompt with probability ``small_fails_hard`` and an easy one with
``small_fails_easy``; the large model fails neither. Whether the small model's answer is good
is drawn once per prompt, so every policy faces the same outcomes and the oracle knows them.

This is a model of traffic, not traffic: how well a scorer does on real prompts depends on
the scorer and on the labels it was fitted to (docs/difficulty.md).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

TOPICS = ("billing", "the weather", "a recipe", "travel plans", "a birthday message", "a poem")
EASY_ASKS = ("What is", "Give me", "Write a short note about", "Tell me about", "List")
HARD_ASKS = (
    "Explain why",
    "Compare and analyze",
    "Design a system for",
    "Derive and prove",
    "Explain how to optimize",
)
CODE = "```python\ndef step(state):\n    return [x * 2 for x in state if x]\n```\n"
MATH = "Let f(x) = x^2 + 3x, then solve the equation f(x) = 10 and the integral of f. "
FILLER = "Some background on the situation follows. "


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request of the benchmark and what each model makes of it."""

    body: dict[str, Any]
    hard: bool
    small_ok: bool
    """The small model's answer is good enough (the large model's always is)."""
    prompt_tokens: int
    output_tokens: int

    def encoded(self) -> bytes:
        """The request body as a client sends it."""
        return json.dumps(self.body).encode()


@dataclass(frozen=True, slots=True)
class PromptMix:
    """How the benchmark's prompts are drawn."""

    hard_share: float = 0.2
    noise: float = 0.15
    small_fails_hard: float = 0.8
    small_fails_easy: float = 0.03


def _one(rng: random.Random, hard: bool, noise: float) -> dict[str, Any]:
    def side() -> bool:
        """The class this feature is drawn from: the prompt's own, or by noise the other."""
        return hard != (rng.random() < noise)

    ask = rng.choice(HARD_ASKS if side() else EASY_ASKS)
    text = f"{ask} {rng.choice(TOPICS)}?"
    if side():
        text += " " + FILLER * rng.randint(20, 120)
    else:
        text += " " + FILLER * rng.randint(0, 6)
    if side():
        text += "\n" + CODE * rng.randint(1, 3)
    if side():
        text += " " + MATH * rng.randint(1, 2)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    turns = rng.randint(2, 6) if side() else rng.randint(0, 1)
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Earlier question {turn}."})
        messages.append({"role": "assistant", "content": f"Earlier answer {turn}."})
    messages.append({"role": "user", "content": text})
    body: dict[str, Any] = {"model": "llama-auto", "messages": messages}
    body["max_tokens"] = rng.choice([1024, 2048, 4096]) if side() else rng.choice([64, 128, 256])
    if side() and rng.random() < 0.5:
        body["reasoning_effort"] = rng.choice(["medium", "high"])
    return body


def generate(n: int, mix: PromptMix, seed: int) -> list[Prompt]:
    """``n`` prompts of ``mix``, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hard = rng.random() < mix.hard_share
        body = _one(rng, hard, mix.noise)
        fails = mix.small_fails_hard if hard else mix.small_fails_easy
        chars = len(json.dumps(body))
        out.append(
            Prompt(
                body=body,
                hard=hard,
                small_ok=rng.random() >= fails,
                prompt_tokens=max(1, chars // 4),
                output_tokens=min(body["max_tokens"], rng.randint(50, 400) * (3 if hard else 1)),
            )
        )
    return out


def labelled_lines(prompts: list[Prompt]) -> list[str]:
    """The prompts as a labelled JSONL file for ``kvpilot difficulty fit``."""
    return [json.dumps({"request": p.body, "small_ok": p.small_ok}) for p in prompts]
