"""A vLLM-like inference engine, simulated in time rather than computed on a GPU.

One `Engine` per replica runs vLLM's scheduling loop: continuous batching of up to
``max_batch`` sequences, chunked prefill under a per-step token budget, a paged KV cache with
automatic prefix caching (`replicasim.kvcache`), and a step time that grows with the work in the
step (uncached prompt tokens to prefill, sequences to decode). Each step is an
``asyncio.sleep``: a replica costs almost no CPU, so a whole cluster fits a laptop.

Times are simulated GPU seconds; ``time_scale`` stretches them into wall-clock seconds (2.0
means the simulated GPU runs half as fast as the real one would), which keeps the HTTP and
Envoy overhead small against the simulated work. Metrics on ``/metrics`` use vLLM's names and
report simulated seconds.

Answers are deterministic: `replicasim.chat.synth_answer` picks ``max_tokens`` one-token words from the
prompt's tokens, so a workload generator can know every answer in advance and a conversation's
next prompt starts with exactly the tokens the replica cached.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from replicasim.chat import chat_tokens, synth_answer
from replicasim.kvcache import Allocation, KVCache, blocks_for, tokenize
from replicasim.prometheus import ITERATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, Histogram


@dataclass(frozen=True)
class SimConfig:
    """The simulated replica's hardware and scheduler. Defaults: an ~8B model on one GPU."""

    max_batch: int = 32
    """Most sequences running at once (vLLM ``max_num_seqs``)."""
    max_batched_tokens: int = 2048
    """Token budget of one step, decode tokens first, prefill chunks after."""
    kv_blocks: int = 8192
    """KV cache capacity in blocks."""
    block_size: int = 16
    """Tokens per KV block."""
    prefill_per_token: float = 1 / 8000
    """Simulated seconds per uncached prompt token."""
    decode_base: float = 0.012
    """Simulated seconds of one step, whatever it holds."""
    decode_per_seq: float = 0.00025
    """Extra simulated seconds per decoding sequence in the step."""
    time_scale: float = 1.0
    """Wall-clock seconds per simulated second."""
    stream_interval: float = 0.1
    """Wall-clock seconds between SSE chunks after the first token (tokens are coalesced)."""
    orca: bool = False
    """Send ORCA ``endpoint-load-metrics`` headers on responses."""
    first_token_delay: float = 0.0
    """Simulated seconds a request waits before it reaches the engine: what a hosted API adds
    (the network, its own queue). 0 for an owned replica (`replicasim.provider`)."""
    rate_limit: float = 0.0
    """Requests per simulated second the replica takes; more are answered 429 with a
    Retry-After, as a paid API's rate limit. 0: no limit (`replicasim.provider`)."""
    rate_burst: float = 0.0
    """Requests the rate limit lets through at once; 0: one second's worth."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SimConfig:
        return cls(**json.loads(text))


class EngineError(Exception):
    """A request the engine cannot serve; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class SimSequence:
    """One request inside the engine."""

    prompt: list[int]
    max_tokens: int
    words: list[str]
    arrival: float
    prefill_left: int = 0
    generated: int = 0
    hit_tokens: int = 0
    allocation: Allocation | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finished: bool = False
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the sequence is finished or aborted."""


MAX_LAG = 0.25
"""Wall-clock seconds an engine may fall behind its step schedule and still catch up."""


class Engine:
    """The scheduling loop and counters of one simulated replica."""

    def __init__(self, config: SimConfig, model: str) -> None:
        self.config = config
        self.model = model
        self.cache = KVCache(config.kv_blocks, config.block_size)
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.slow_factor = 1.0
        """Fault injection: every step takes this many times longer."""
        self._wake = asyncio.Event()
        self._zero_counters()

    def _zero_counters(self) -> None:
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0
        self.busy_seconds = 0.0
        self.prefill_seconds = 0.0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self.started_at = time.monotonic()

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: list[int], max_tokens: int) -> SimSequence:
        """Queue a request; its `changed` event fires as tokens arrive."""
        if max_tokens < 1:
            raise EngineError(400, "max_tokens must be at least 1")
        if not prompt:
            raise EngineError(400, "the prompt is empty")
        need = blocks_for(len(prompt) + max_tokens, self.config.block_size)
        if need > self.config.kv_blocks:
            raise EngineError(
                400,
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) needs {need} KV "
                f"blocks; this replica has {self.config.kv_blocks}",
            )
        seq = SimSequence(
            prompt=prompt,
            max_tokens=max_tokens,
            words=synth_answer(prompt, max_tokens),
            arrival=time.monotonic(),
        )
        self.waiting.append(seq)
        self._wake.set()
        return seq

    def abort(self, seq: SimSequence, reason: str = "aborted") -> None:
        """Take a request out (client gone, replica dying); frees its blocks."""
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        seq.finished = True
        seq.error = reason
        seq.changed.set()
        seq.done.set()

    def abort_all(self, reason: str) -> None:
        for seq in [*self.waiting, *self.running]:
            self.abort(seq, reason)

    def reset(self, drop_cache: bool = True, kv_blocks: int | None = None) -> dict[str, int]:
        """Drop the unreferenced prefix cache (unless `drop_cache` is False) and zero the
        counters: between benchmark runs, and after warming a fresh cache. `kv_blocks` gives
        the replica a KV cache of that size instead (an empty one; only while idle), for
        fleets of unequal replicas."""
        if kv_blocks is not None and kv_blocks != self.cache.capacity:
            if self.running or self.waiting:
                raise EngineError(409, "the KV cache can change size only while idle")
            dropped = self.cache.cached
            self.cache = KVCache(kv_blocks, self.config.block_size)
        else:
            dropped = self.cache.drop_unreferenced() if drop_cache else 0
        self._zero_counters()
        return {"dropped_blocks": dropped, "kv_blocks": self.cache.capacity}

    def preload(self, payloads: Sequence[dict[str, Any]]) -> int:
        """Put each chat payload's prompt in the prefix cache as if it had just been served,
        without spending simulated time on its prefill: a fleet in service already holds
        its shared system prompts, and warming them through requests only costs wall time.
        Returns how many blocks the cache holds afterwards."""
        for payload in payloads:
            prompt = prompt_tokens("chat", payload)
            allocation = self.cache.allocate(prompt, 1)
            if allocation is None:
                raise EngineError(409, "the prompts to preload do not fit in the KV cache")
            self.cache.release(allocation, prompt)
        return self.cache.cached

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Step until cancelled; sleeps on an event while idle, never spins.

        Steps end on a schedule (the previous step's end plus this step's time), not a sleep
        after the Python work: on a busy machine the event loop wakes late, and sleeping the
        full step time again would add every delay to the simulated GPU's time. A late step
        is followed by shorter sleeps until the schedule is met, up to ``MAX_LAG`` behind.
        """
        config = self.config
        due: float | None = None
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                due = None
            self._admit()
            if not self.running:
                # The head does not fit even in an empty batch: impossible after submit()'s
                # check unless the cache is pinned by nothing; wait for more room.
                self._wake.clear()
                await self._wake.wait()
                due = None
                continue
            budget = config.max_batched_tokens
            decoding = [s for s in self.running if s.prefill_left == 0]
            budget -= len(decoding)
            chunks: list[tuple[SimSequence, int]] = []
            prefill_tokens = 0
            for seq in self.running:
                if budget <= 0:
                    break
                if seq.prefill_left:
                    take = min(seq.prefill_left, budget)
                    chunks.append((seq, take))
                    budget -= take
                    prefill_tokens += take
            step = (
                config.decode_base
                + config.decode_per_seq * len(decoding)
                + config.prefill_per_token * prefill_tokens
            ) * self.slow_factor
            started = time.monotonic()
            if due is None or due < started - MAX_LAG:
                due = started
            due += step * config.time_scale
            await asyncio.sleep(max(0.0, due - started))
            self.busy_seconds += step
            self.prefill_seconds += config.prefill_per_token * prefill_tokens * self.slow_factor
            self.iteration_tokens.observe(len(decoding) + prefill_tokens)
            now = time.monotonic()
            decoded = 0
            for seq in decoding:
                if not seq.finished:
                    seq.generated += 1
                    decoded += 1
                    seq.changed.set()
            if decoded:
                # vLLM observes each output token after the first: the step it took.
                self.tpot.observe(step, decoded)
            for seq, take in chunks:
                if seq.finished:
                    continue
                seq.prefill_left -= take
                if seq.prefill_left == 0:
                    seq.generated = 1
                    seq.first_token_at = now
                    self.ttft.observe((now - seq.arrival) / config.time_scale)
                    seq.changed.set()
            done = [s for s in self.running if s.generated >= s.max_tokens]
            for seq in done:
                self.running.remove(seq)
                self._release(seq)
                seq.finished = True
                seq.finished_at = now
                self.finished += 1
                self.generation_tokens += seq.generated
                seq.changed.set()
                seq.done.set()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            allocation = self.cache.allocate(seq.prompt, seq.max_tokens)
            if allocation is None:
                return
            self.waiting.popleft()
            seq.allocation = allocation
            seq.hit_tokens = allocation.hit_blocks * self.config.block_size
            seq.prefill_left = len(seq.prompt) - seq.hit_tokens
            self.prefix_queries += len(seq.prompt)
            self.prefix_hits += seq.hit_tokens
            self.prompt_tokens += len(seq.prompt)
            self.running.append(seq)

    def _release(self, seq: SimSequence) -> None:
        if seq.allocation is not None:
            generated = tokenize(" ".join(seq.words[: seq.generated]))
            self.cache.release(seq.allocation, seq.prompt + generated)
            seq.allocation = None
            self._wake.set()

    # ------------------------------------------------------------------ telemetry

    def utilization(self) -> float:
        """Share of the batch in use, 0 to 1 (the ORCA cpu_utilization stand-in)."""
        return min(1.0, (len(self.running) + len(self.waiting)) / self.config.max_batch)

    def orca_header(self) -> str:
        """ORCA in-band load report, Envoy's TEXT format for ``endpoint-load-metrics``.

        The named metrics carry vLLM's own names (``kv_cache_usage_perc``,
        ``num_requests_waiting``), which is what kvpilot's ORCA clusters read.
        """
        return (
            f"TEXT cpu_utilization={self.utilization():.3f}, "
            f"named_metrics.kv_cache_usage_perc={self.cache.usage:.3f}, "
            f"named_metrics.num_requests_waiting={len(self.waiting)}"
        )

    def metrics_lines(self) -> list[str]:
        """vLLM-named metrics, plus the simulator's busy time."""
        labels = f'model_name="{self.model}"'
        usage = self.cache.usage
        values: list[tuple[str, str, str, float]] = [
            ("vllm:num_requests_running", "gauge", "Requests in the batch.", len(self.running)),
            ("vllm:num_requests_waiting", "gauge", "Requests queued.", len(self.waiting)),
            ("vllm:kv_cache_usage_perc", "gauge", "KV cache usage, 1 = 100 percent.", usage),
            ("vllm:gpu_cache_usage_perc", "gauge", "Older name of kv_cache_usage_perc.", usage),
            (
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                self.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prompt tokens found in the prefix cache.",
                self.prefix_hits,
            ),
            ("vllm:prompt_tokens_total", "counter", "Prompt tokens.", self.prompt_tokens),
            (
                "vllm:generation_tokens_total",
                "counter",
                "Generated tokens.",
                self.generation_tokens,
            ),
            ("vllm:request_success_total", "counter", "Finished requests.", self.finished),
            (
                "kvpilot_sim_busy_seconds_total",
                "counter",
                "Simulated seconds the engine spent stepping.",
                self.busy_seconds,
            ),
            (
                "kvpilot_sim_prefill_seconds_total",
                "counter",
                "Simulated seconds of those steps spent computing prompt tokens.",
                self.prefill_seconds,
            ),
            (
                "kvpilot_sim_elapsed_seconds",
                "gauge",
                "Simulated seconds since the counters were reset.",
                (time.monotonic() - self.started_at) / self.config.time_scale,
            ),
        ]
        lines: list[str] = []
        for name, kind, help_text, value in values:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} {kind}",
                f"{name}{{{labels}}} {float(value)}",
            ]
        lines += [
            "# HELP vllm:time_to_first_token_seconds Time to first token, simulated seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *self.ttft.lines("vllm:time_to_first_token_seconds", labels),
            "# HELP vllm:time_per_output_token_seconds Time per output token, simulated seconds.",
            "# TYPE vllm:time_per_output_token_seconds histogram",
            *self.tpot.lines("vllm:time_per_output_token_seconds", labels),
            "# HELP vllm:iteration_tokens_total Tokens per engine step.",
            "# TYPE vllm:iteration_tokens_total histogram",
            *self.iteration_tokens.lines("vllm:iteration_tokens_total", labels),
        ]
        return lines


def prompt_tokens(kind: str, payload: dict[str, Any]) -> list[int]:
    """The prompt's tokens of a chat (`kind` "chat") or text completion request."""
    if kind == "chat":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise EngineError(400, "messages must be a list of objects")
        return chat_tokens(messages)
    prompt = payload.get("prompt")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    if not isinstance(prompt, str):
        raise EngineError(400, "prompt must be a string")
    return tokenize(prompt)
