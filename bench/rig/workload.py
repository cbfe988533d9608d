"""Deterministic LLM workloads: multi-turn chat sessions, a shared long document, or a mix.

A workload is plain data computed up front from a seed: every session's start time, every
turn's messages, ``max_tokens`` and think time, and even every answer (the simulator's answers
are a pure function of the prompt, `replicasim.simulator.synth_answer`). So every routing policy
replays exactly the same requests, and the oracle hit rate comes from the workload alone.

- Multi-turn chat: a few shared system prompts; each turn sends the whole conversation so far
  (the previous answers included) plus a new question, with the session id in
  ``x-session-id``. Turns follow the previous answer after a think time.
- Shared document: a few long documents; each request is one document plus a question, with
  no session id (many users asking about the same files).
- Mix: both at once.

Prompt and answer lengths are log-normal (heavy-tailed, capped); sessions and document
requests arrive as a Poisson process or, with ``arrival="bursty"``, with gamma-distributed gaps
of the same mean and a coefficient of variation of 2 (vLLM's benchmark ``--burstiness 0.25``).
Times are simulated seconds.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from bench.rig.jsonfields import known
from replicasim.chat import chat_tokens, synth_answer
from replicasim.kvcache import BLOCK_SIZE, block_hashes, tokenize
from replicasim.simulator import SimConfig

WorkloadKind = Literal["multiturn", "docs", "mix"]
Arrival = Literal["poisson", "bursty"]
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class WorkloadConfig:
    """The knobs of a workload; the same config and seed give the same requests."""

    kind: WorkloadKind = "multiturn"
    seed: int = 7
    duration: float = 60.0
    """Simulated seconds during which new sessions and document requests start."""
    session_rate: float = 1.0
    """New chat sessions per simulated second."""
    doc_rate: float = 2.0
    """Document requests per simulated second (docs and mix)."""
    arrival: Arrival = "poisson"
    system_prompts: tuple[int, ...] = (300, 600, 900, 1200)
    """Token lengths of the shared system prompts."""
    max_turns: int = 8
    mean_turns: float = 4.0
    """Turns per session: 1 + geometric, capped at ``max_turns``."""
    question_median: int = 60
    answer_median: int = 120
    length_sigma: float = 0.8
    """Log-normal sigma of question and answer lengths."""
    length_cap: int = 800
    think_mean: float = 2.0
    """Mean think time between an answer and the next question, simulated seconds."""
    documents: tuple[int, ...] = (2000, 3000, 4000, 5000)
    """Token lengths of the shared documents."""
    doc_popularity: float = 0.0
    """Zipf exponent of document popularity: the k-th document is asked about in proportion
    to 1/k^s (1.0: the first of eight takes 37% of the requests). 0 picks uniformly."""


CHAT = WorkloadConfig(
    kind="multiturn",
    duration=80.0,
    system_prompts=(1000, 2000, 3000, 4000),
    question_median=100,
    answer_median=200,
    length_cap=600,
    mean_turns=5.0,
    max_turns=8,
    think_mean=3.0,
)
"""Multi-turn chat as people use it, the benchmarks' chat: a few long shared system prompts,
five turns on average (up to eight), each prompt the whole conversation so far, so histories
grow to thousands of tokens; heavy-tailed questions and answers."""


@dataclass(frozen=True)
class Turn:
    """One request of a session."""

    messages: tuple[dict[str, str], ...]
    max_tokens: int
    think: float
    """Simulated seconds to wait after the previous turn's answer before sending this one."""
    prompt_tokens: int
    answer: str
    """What the simulator will answer."""


@dataclass(frozen=True)
class Session:
    """A chat session (several turns, with a session id) or a single document request."""

    id: str
    start: float
    """Simulated seconds from the workload start."""
    turns: tuple[Turn, ...]
    send_session_id: bool
    extra_headers: tuple[tuple[str, str], ...] = ()
    """Headers sent with every request of the session besides the session id (a tenant, a
    service class)."""

    def headers(self) -> dict[str, str]:
        headers = dict(self.extra_headers)
        if self.send_session_id:
            headers[SESSION_HEADER] = self.id
        return headers


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    sessions: tuple[Session, ...] = field(repr=False)

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def system_prompts(self) -> list[str]:
        """The distinct system messages of the chat sessions, in order of first use."""
        seen: dict[str, None] = {}
        for session in self.sessions:
            if session.send_session_id and session.turns:
                first = session.turns[0].messages[0]
                if first.get("role") == "system":
                    seen.setdefault(first["content"], None)
        return list(seen)

    def turns_in_order(self) -> Iterator[tuple[float, Session, Turn]]:
        """Every turn at its nominal time (think times only; answers take no time)."""
        timed = []
        for session in self.sessions:
            at = session.start
            for turn in session.turns:
                at += turn.think
                timed.append((at, session, turn))
        timed.sort(key=lambda item: item[0])
        return iter(timed)

    def summary(self) -> WorkloadSummary:
        prompts = [t.prompt_tokens for s in self.sessions for t in s.turns]
        answers = [t.max_tokens for s in self.sessions for t in s.turns]
        chats = [len(s.turns) for s in self.sessions if s.send_session_id]
        return WorkloadSummary(
            kind=self.config.kind,
            seed=self.config.seed,
            arrival=self.config.arrival,
            sessions=sum(1 for s in self.sessions if s.send_session_id),
            document_requests=sum(1 for s in self.sessions if not s.send_session_id),
            requests=self.requests,
            turns_mean=sum(chats) / max(1, len(chats)),
            prompt_tokens_p50=sorted(prompts)[len(prompts) // 2] if prompts else 0,
            prompt_tokens_mean=sum(prompts) / max(1, len(prompts)),
            prompt_tokens_max=max(prompts, default=0),
            answer_tokens_mean=sum(answers) / max(1, len(answers)),
            answer_tokens_max=max(answers, default=0),
        )


@dataclass(frozen=True, kw_only=True)
class WorkloadSummary:
    """What a workload holds, for a report's description of it (a results file keeps it
    under these names)."""

    kind: str
    seed: int
    arrival: str
    sessions: int
    """Chat sessions (with a session id)."""
    document_requests: int
    requests: int
    turns_mean: float = 0.0
    """Turns per chat session (0 in files of runs from before it was kept)."""
    prompt_tokens_p50: int = 0
    prompt_tokens_mean: float
    prompt_tokens_max: int
    answer_tokens_mean: float
    answer_tokens_max: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkloadSummary:
        """The summary as a results file holds it (other keys beside it are ignored)."""
        return cls(**known(cls, data))


def _words(rng: random.Random, tokens: int) -> str:
    """`tokens` random 4-letter words: one token each, unlike any other text's."""
    letters = string.ascii_lowercase
    return " ".join("".join(rng.choices(letters, k=4)) for _ in range(tokens))


def _length(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _arrivals(rng: random.Random, rate: float, duration: float, arrival: Arrival) -> list[float]:
    times: list[float] = []
    if rate <= 0:
        return times
    now = 0.0
    while True:
        if arrival == "bursty":
            shape = 0.25
            now += rng.gammavariate(shape, 1.0 / (rate * shape))
        else:
            now += rng.expovariate(rate)
        if now >= duration:
            return times
        times.append(now)


def _turn(messages: list[dict[str, str]], max_tokens: int, think: float) -> Turn:
    prompt = chat_tokens(messages)
    answer = " ".join(synth_answer(prompt, max_tokens))
    return Turn(tuple(messages), max_tokens, think, len(prompt), answer)


def generate(config: WorkloadConfig) -> Workload:
    """Build the workload for `config` (deterministic in its seed).

    Arrival times and each session's content come from separate random streams, so a higher
    rate compresses the same arrivals and adds sessions while the first N sessions stay the
    same: the offered load grows smoothly with the rate, which lets calibration converge.
    """
    rng = random.Random(config.seed)
    systems = [_words(rng, n) for n in config.system_prompts]
    documents = [_words(rng, n) for n in config.documents]
    sessions: list[Session] = []
    c = config
    if c.kind in ("multiturn", "mix"):
        p_stop = 1.0 / max(1.0, c.mean_turns)
        arrivals = random.Random(f"{c.seed}/chat-arrivals")
        for index, start in enumerate(_arrivals(arrivals, c.session_rate, c.duration, c.arrival)):
            rng = random.Random(f"{c.seed}/chat/{index}")
            turns_wanted = 1
            while turns_wanted < c.max_turns and rng.random() > p_stop:
                turns_wanted += 1
            messages = [{"role": "system", "content": rng.choice(systems)}]
            turns: list[Turn] = []
            for number in range(turns_wanted):
                question = _words(rng, _length(rng, c.question_median, c.length_sigma, 1000))
                messages.append({"role": "user", "content": question})
                answer_len = _length(rng, c.answer_median, c.length_sigma, c.length_cap)
                think = 0.0 if number == 0 else rng.expovariate(1.0 / c.think_mean)
                turn = _turn(list(messages), answer_len, think)
                turns.append(turn)
                messages.append({"role": "assistant", "content": turn.answer})
            sessions.append(Session(f"s{c.seed}-{index:05d}", start, tuple(turns), True))
    if c.kind in ("docs", "mix"):
        arrivals = random.Random(f"{c.seed}/doc-arrivals")
        for index, start in enumerate(_arrivals(arrivals, c.doc_rate, c.duration, c.arrival)):
            rng = random.Random(f"{c.seed}/doc/{index}")
            if c.doc_popularity > 0:
                zipf = [1.0 / (k + 1) ** c.doc_popularity for k in range(len(documents))]
                document = rng.choices(documents, weights=zipf)[0]
            else:
                document = rng.choice(documents)
            question = _words(rng, _length(rng, c.question_median, c.length_sigma, 1000))
            messages = [
                {"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": f"{document} {question}"},
            ]
            answer_len = _length(rng, c.answer_median, c.length_sigma, c.length_cap)
            sessions.append(
                Session(f"d{c.seed}-{index:05d}", start, (_turn(messages, answer_len, 0.0),), False)
            )
    sessions.sort(key=lambda s: s.start)
    return Workload(config, tuple(sessions))


# --------------------------------------------------------------------------- bounds and load


def warm_blocks(system_prompts: Sequence[str], block_size: int = BLOCK_SIZE) -> set[int]:
    """The cached blocks a replica holds after serving each system prompt once on its own."""
    out: set[int] = set()
    for prompt in system_prompts:
        tokens = chat_tokens([{"role": "system", "content": prompt}])
        out.update(block_hashes(tokens, block_size))
    return out


def oracle_hit_rate(
    workload: Workload, block_size: int = BLOCK_SIZE, warm: Sequence[str] = ()
) -> float:
    """Prefix-cache hit rate with perfect affinity and an infinite cache.

    Every request meets every block any earlier request computed (prompt and answer), in the
    workload's nominal order, plus the `warm` system prompts' blocks from the start. As in
    the simulator, a prompt's last token is always computed.
    """
    seen: set[int] = warm_blocks(warm, block_size)
    queries = hits = 0
    for _, _, turn in workload.turns_in_order():
        prompt = chat_tokens(turn.messages)
        hashes = block_hashes(prompt, block_size)
        matched = 0
        for value in hashes:
            if value not in seen:
                break
            matched += 1
        if matched and matched * block_size >= len(prompt):
            matched -= 1
        queries += len(prompt)
        hits += matched * block_size
        seen.update(block_hashes(prompt + tokenize(turn.answer), block_size))
    return hits / queries if queries else 0.0


def cache_blind_cost(
    workload: Workload,
    sim: SimConfig,
    replicas: int,
    warm: Sequence[str] = (),
    batch: int | None = None,
) -> float:
    """Simulated engine seconds the workload costs when routing ignores the cache.

    Round robin over `replicas` replicas with unbounded caches: a request hits only what the
    same replica computed before (shared system prompts, and its own session's turns one time
    in `replicas`; every replica starts with the `warm` system prompts' blocks). Decode is
    charged per token at a batch of `batch` sequences (default: half full; a full batch is
    the cost at capacity, where every step carries as many sequences as it can). It is an
    estimate for choosing the offered load, not a measurement.
    """
    start = warm_blocks(warm, sim.block_size)
    seen: list[set[int]] = [set(start) for _ in range(replicas)]
    batch = max(1, batch if batch is not None else sim.max_batch // 2)
    decode_per_token = sim.decode_per_seq + sim.decode_base / batch
    total = 0.0
    for index, (_, _, turn) in enumerate(workload.turns_in_order()):
        cache = seen[index % replicas]
        prompt = chat_tokens(turn.messages)
        hashes = block_hashes(prompt, sim.block_size)
        matched = 0
        for value in hashes:
            if value not in cache:
                break
            matched += 1
        uncached = len(prompt) - min(matched * sim.block_size, len(prompt) - 1)
        total += uncached * sim.prefill_per_token + turn.max_tokens * decode_per_token
        cache.update(block_hashes(prompt + tokenize(turn.answer), sim.block_size))
    return total
