"""The simulator's KV cache and prefix caching, as pure code (no processes, no event loop)."""

from __future__ import annotations

import pytest

from replicasim.chat import render_chat, synth_answer
from replicasim.kvcache import BLOCK_SIZE, KVCache, block_hashes, blocks_for, tokenize


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize(
    ("text", "expected_len"),
    [
        ("", 0),
        ("a", 1),
        ("abcd", 1),
        ("abcde", 2),
        ("one two  three\nfour", 5),
    ],
)
def test_tokenize_cuts_words_into_four_character_chunks(text: str, expected_len: int) -> None:
    assert len(tokenize(text)) == expected_len


def test_tokenize_is_deterministic_and_concatenates() -> None:
    assert tokenize("hello world") == tokenize("hello world")
    assert tokenize("hello world again") == tokenize("hello world") + tokenize("again")


@pytest.mark.parametrize(
    ("tokens", "blocks"),
    [(0, 0), (15, 0), (16, 1), (17, 1), (32, 2), (100, 6)],
)
def test_only_full_blocks_get_hashes(tokens: int, blocks: int) -> None:
    assert len(block_hashes(toks(tokens))) == blocks


def test_block_hashes_are_chained() -> None:
    a = toks(32)
    b = [999, *toks(31, 1)]
    # Same second block content, different first block: the second hash differs too.
    assert a[16:] == b[16:]
    assert block_hashes(a)[1] != block_hashes(b)[1]
    assert block_hashes(a + toks(16, 500))[:2] == block_hashes(a)


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (16, 1), (17, 2)])
def test_blocks_for_rounds_up(tokens: int, blocks: int) -> None:
    assert blocks_for(tokens) == blocks


# A table of (cached prompt length, new prompt, expected hit blocks): what the second request
# hits after a first request with prompt toks(cached) finished.
@pytest.mark.parametrize(
    ("first", "second", "hits"),
    [
        pytest.param(64, toks(64) + toks(40, 1000), 4, id="full-prefix-hit"),
        pytest.param(64, toks(64), 3, id="identical-prompt-recomputes-last-block"),
        pytest.param(64, toks(70), 4, id="identical-plus-partial"),
        pytest.param(64, toks(20), 1, id="shorter-prompt"),
        pytest.param(64, toks(64, 1), 0, id="different-first-token"),
        pytest.param(64, [*toks(40), 7, *toks(40, 41)], 2, id="divergence-in-block-3"),
        pytest.param(8, toks(40), 0, id="partial-block-is-not-cached"),
    ],
)
def test_prefix_hits(first: int, second: list[int], hits: int) -> None:
    cache = KVCache(capacity=100)
    allocation = cache.allocate(toks(first), 4)
    assert allocation is not None and allocation.hit_blocks == 0
    cache.release(allocation, toks(first))
    again = cache.allocate(second, 4)
    assert again is not None
    assert again.hit_blocks == hits


def test_generated_blocks_are_cached_for_the_next_turn() -> None:
    cache = KVCache(capacity=100)
    prompt = toks(40)
    allocation = cache.allocate(prompt, 30)
    assert allocation is not None
    answer = toks(30, 5000)
    cache.release(allocation, prompt + answer)
    # 70 tokens: 4 full blocks now exist; the next turn hits all of them.
    nxt = cache.allocate(prompt + answer + toks(20, 9000), 5)
    assert nxt is not None and nxt.hit_blocks == 4


def test_allocation_reserves_prompt_and_answer_and_release_frees() -> None:
    cache = KVCache(capacity=10)
    allocation = cache.allocate(toks(40), 40)  # 80 tokens = 5 blocks, 2 of them named
    assert allocation is not None
    assert (cache.used, cache.free, cache.usage) == (5, 5, 0.5)
    cache.release(allocation, toks(40))
    # Named blocks stay cached but are free for others; anonymous ones are gone.
    assert (cache.used, cache.free, cache.usage, cache.cached) == (2, 10, 0.0, 2)


def test_allocation_fails_when_referenced_blocks_leave_no_room() -> None:
    cache = KVCache(capacity=4)
    held = cache.allocate(toks(32), 16)  # 3 blocks
    assert held is not None
    assert cache.allocate(toks(16, 100), 16) is None  # needs 2, 1 free
    cache.release(held, toks(32))
    assert cache.allocate(toks(16, 100), 16) is not None


def test_lru_evicts_least_recently_released_and_tail_first() -> None:
    cache = KVCache(capacity=6)
    for start in (0, 100):
        allocation = cache.allocate(toks(48, start), 0)
        assert allocation is not None
        cache.release(allocation, toks(48, start))
    assert cache.cached == 6
    # Four fresh blocks must evict four: all three of the older prompt's, tail first, then
    # the tail of the newer one.
    fresh = cache.allocate(toks(64, 1000), 0)
    assert fresh is not None
    assert cache.evictions == 4
    assert cache.match(block_hashes(toks(48, 0))) == 0
    assert cache.match(block_hashes(toks(48, 100))) == 2


def test_a_shared_head_survives_eviction_of_tails() -> None:
    cache = KVCache(capacity=8)
    head = toks(32)
    for tail in (1000, 2000, 3000):
        prompt = head + toks(32, tail)
        allocation = cache.allocate(prompt, 0)
        assert allocation is not None
        cache.release(allocation, prompt)
    assert cache.match(block_hashes(head)) == 2


def test_shared_blocks_are_counted_once_and_pinned_while_referenced() -> None:
    cache = KVCache(capacity=5)
    a = cache.allocate(toks(48), 0)
    b = cache.allocate(toks(48) + toks(16, 500), 0)
    assert a is not None and b is not None
    assert b.hit_blocks == 3
    assert cache.used == 4
    # Both hold the shared three; nothing is evictable, one block is free.
    assert cache.allocate(toks(32, 900), 0) is None
    cache.release(a, toks(48))
    assert cache.allocate(toks(32, 900), 0) is None  # still referenced by b
    cache.release(b, toks(48) + toks(16, 500))
    assert cache.allocate(toks(32, 900), 0) is not None


def test_drop_unreferenced_forgets_the_cache_but_not_running_sequences() -> None:
    cache = KVCache(capacity=10)
    done = cache.allocate(toks(32), 0)
    assert done is not None
    cache.release(done, toks(32))
    running = cache.allocate(toks(32, 100), 0)
    assert running is not None
    assert cache.drop_unreferenced() == 2
    assert cache.match(block_hashes(toks(32))) == 0
    assert cache.used == 2


def test_answers_are_a_pure_function_of_the_prompt_and_one_token_per_word() -> None:
    prompt = tokenize(render_chat([{"role": "user", "content": "hello"}]))
    words = synth_answer(prompt, 25)
    assert words == synth_answer(prompt, 25)
    assert len(tokenize(" ".join(words))) == 25
    assert synth_answer([*prompt, 1], 25) != words


def test_chat_prompt_plus_answer_prefixes_the_next_turn() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt1 = tokenize(render_chat(turn1))
    answer = " ".join(synth_answer(prompt1, 40))
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "ok"}]
    prompt2 = tokenize(render_chat(turn2))
    assert prompt2[: len(prompt1) + 40] == prompt1 + tokenize(answer)
    assert BLOCK_SIZE == 16
