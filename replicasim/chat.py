"""The simulated model's text: how a chat becomes a prompt, and what the model answers.

`render_chat` is a whitespace-separated stand-in for a chat template, `chat_tokens` its
tokens (`replicasim.kvcache.tokenize`) computed part by part, and `synth_answer` the answer: a pure
function of the prompt, so a workload generator knows every answer in advance and a
conversation's next prompt starts with exactly the tokens the replica cached.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Sequence
from typing import Any

from replicasim.kvcache import tokenize

_WORDS = (
    "the of and to in is it that was for on are with as at be by this have from or one had "
    "not but what all were when we can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has "
    "look two more go see no way could my than been call who its now find long down day did "
    "get come made may part over new sound take only work know place year live me back give "
    "most very after our just name good man think say great where help much too mean old any "
    "same tell boy came want show also form three small set put end does well large must big "
    "even such turn here why ask went men read need land home us move try kind hand off "
    "again play away spel air line"
)
_VOCAB = tuple(word for word in _WORDS.split() if len(word) <= 4)
"""Answer words: at most 4 characters, so one word is one token."""


def _parts(messages: Sequence[dict[str, Any]]) -> list[str]:
    """One part per message, then the assistant marker."""
    parts = [f"<|{m.get('role', 'user')}|> {m.get('content') or ''}" for m in messages]
    return [*parts, "<|assistant|>"]


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """The prompt text of a chat request: a whitespace-separated stand-in for a chat template.

    It ends with the assistant marker, so prompt + answer is a prefix of the next turn's prompt.
    """
    return " ".join(_parts(messages))


def synth_answer(prompt: Sequence[int], max_tokens: int) -> list[str]:
    """The answer to `prompt`: `max_tokens` one-token words, a pure function of the prompt."""
    seed = zlib.crc32(b"%d:" % len(prompt) + b",".join(b"%d" % t for t in prompt[-64:]))
    return random.Random(seed).choices(_VOCAB, k=max_tokens)


@functools.lru_cache(maxsize=16384)
def _part_tokens(part: str) -> tuple[int, ...]:
    return tuple(tokenize(part))


def chat_tokens(messages: Sequence[dict[str, Any]]) -> list[int]:
    """``tokenize(render_chat(messages))``, part by part.

    tokenize(a + " " + b) == tokenize(a) + tokenize(b): tokenizing the rendered chat part by
    part lets every turn reuse the parts (system prompt, history) seen before, which keeps the
    CPU per request small when prompts grow to thousands of tokens (the simulator's for
    each request, the workload generator's for each turn it plans)."""
    tokens: list[int] = []
    for part in _parts(messages):
        tokens += _part_tokens(part)
    return tokens
