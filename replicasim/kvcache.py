"""A vLLM-style paged KV cache with automatic prefix caching, as pure code.

The cache holds ``capacity`` blocks of ``block_size`` tokens. A full block is named by a chained
hash (its tokens plus the hash of the block before it), so two prompts share a cached block only
when everything before it is identical too, as in vLLM's automatic prefix caching. Blocks that
no running sequence references stay cached and are evicted least recently used first, only when
a new allocation needs the room.

Simplifications against vLLM, chosen to keep the simulator cheap and free of preemption:

- a sequence reserves every block it can need (prompt plus ``max_tokens``) when admitted;
- a prompt's full blocks are named (and can be hit by others) from admission on, not once
  their prefill finishes;
- the blocks of generated tokens are named when the sequence finishes.

Tokens are plain ints; `tokenize` is the deterministic stand-in for a real tokenizer.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK_SIZE = 16


def tokenize(text: str) -> list[int]:
    """Deterministic tokenizer approximation: whitespace words cut into 4-character chunks.

    Each chunk becomes a 32-bit id (CRC-32), so the same text gives the same tokens in every
    process, and ``tokenize(a + " " + b) == tokenize(a) + tokenize(b)``: a conversation's
    next prompt starts with exactly the tokens of the previous prompt and answer.
    """
    tokens: list[int] = []
    for word in text.split():
        for start in range(0, len(word), 4):
            tokens.append(zlib.crc32(word[start : start + 4].encode()))
    return tokens


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """Chained hashes of the full blocks of `tokens` (a trailing partial block has none)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks needed to hold `tokens` tokens."""
    return -(-tokens // block_size)


@dataclass
class Allocation:
    """The blocks one admitted sequence holds."""

    hashed: list[int]
    """Named blocks it references (its cached prefix, then its new full prompt blocks)."""
    anonymous: int
    """Blocks it holds without a name (partial prompt block and room for generated tokens)."""
    hit_blocks: int
    """How many of its leading prompt blocks were already cached."""


@dataclass
class KVCache:
    """Block accounting and the prefix cache of one replica."""

    capacity: int
    """Total blocks."""
    block_size: int = BLOCK_SIZE
    _refs: dict[int, int] = field(default_factory=dict)
    """Reference count of every named block (cached or in use)."""
    _lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    """Named blocks with no references, least recently used first: the evictable ones."""
    _anonymous: int = 0
    evictions: int = 0
    """Blocks evicted so far."""

    # ------------------------------------------------------------------ queries

    @property
    def used(self) -> int:
        """Blocks holding something (referenced, or cached and evictable)."""
        return len(self._refs) + self._anonymous

    @property
    def free(self) -> int:
        """Blocks an allocation can take: empty ones plus evictable cached ones."""
        return self.capacity - self.used + len(self._lru)

    @property
    def usage(self) -> float:
        """Referenced blocks over capacity, as vLLM's ``kv_cache_usage_perc`` (0 to 1)."""
        return (self.used - len(self._lru)) / self.capacity if self.capacity else 0.0

    @property
    def cached(self) -> int:
        """Named blocks, referenced or not."""
        return len(self._refs)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` that are cached."""
        count = 0
        for value in hashes:
            if value not in self._refs:
                break
            count += 1
        return count

    # ------------------------------------------------------------------ changes

    def allocate(self, prompt: Sequence[int], max_new_tokens: int) -> Allocation | None:
        """Reserve blocks for a prompt and its answer; None when they do not fit now.

        At least the prompt's last token is always computed (vLLM does the same), so a fully
        cached prompt still misses its last block.
        """
        hashes = block_hashes(prompt, self.block_size)
        hits = self.match(hashes)
        if hits and hits * self.block_size >= len(prompt):
            hits -= 1
        reused = [value for value in hashes if value in self._refs]
        new = [value for value in hashes if value not in self._refs]
        anonymous = blocks_for(len(prompt) + max_new_tokens, self.block_size) - len(hashes)
        take = len(new) + anonymous
        # Cached blocks this sequence is about to reference can no longer be evicted for it.
        pinned = sum(1 for value in reused if self._refs[value] == 0)
        if take > self.free - pinned:
            return None
        for value in reused:
            self._ref(value)
        self._make_room(take)
        for value in new:
            self._refs[value] = 1
        self._anonymous += anonymous
        return Allocation(hashed=hashes, anonymous=anonymous, hit_blocks=hits)

    def release(self, allocation: Allocation, tokens: Sequence[int]) -> None:
        """Free a finished sequence's blocks; the full blocks of `tokens` (prompt and generated)
        stay cached and evictable.

        As in vLLM, a sequence's blocks join the eviction queue tail first, so eviction eats a
        conversation from its end and the shared head (the system prompt) survives longest.
        """
        self._anonymous -= allocation.anonymous
        generated = block_hashes(tokens, self.block_size)[len(allocation.hashed) :]
        for value in reversed(generated[: allocation.anonymous]):
            if value not in self._refs:
                self._refs[value] = 0
                self._lru[value] = None
        for value in reversed(allocation.hashed):
            self._unref(value)

    def drop_unreferenced(self) -> int:
        """Forget every cached block no running sequence references; returns how many."""
        dropped = len(self._lru)
        for value in self._lru:
            del self._refs[value]
        self._lru.clear()
        return dropped

    # ------------------------------------------------------------------ internals

    def _evictable_among(self, hashes: Sequence[int]) -> int:
        return sum(1 for value in hashes if value in self._lru)

    def _ref(self, value: int) -> None:
        if self._refs[value] == 0:
            del self._lru[value]
        self._refs[value] += 1

    def _unref(self, value: int) -> None:
        self._refs[value] -= 1
        if self._refs[value] == 0:
            self._lru[value] = None
            self._lru.move_to_end(value)

    def _make_room(self, blocks: int) -> None:
        while self.capacity - self.used < blocks:
            victim, _ = self._lru.popitem(last=False)
            del self._refs[victim]
            self.evictions += 1
