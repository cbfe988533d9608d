"""When an agent writes a telemetry record again (pure, no I/O): ``WriteBand``, how far a record
must move from the one last written. Reading a record out of a scrape is ``signals.telemetry``."""

from __future__ import annotations

from dataclasses import dataclass

from signals.telemetry import TelemetryRecord


@dataclass(frozen=True, slots=True)
class WriteBand:
    """How far a record must move from the one last written before an agent writes it again.

    At 10,000 endpoints scraped every second, writing every wiggle is 10,000 etcd writes and
    as many reconciler wakeups a second, for changes the weight function's own quantization
    band throws away. Counts (waiting, running, pending tokens) move when they change by more
    than ``relative`` of the larger value and by at least their floor, so a short queue still
    counts every request (the time to first token moves like a count); fractions (KV-cache use, prefix hit rate) when they move by more than
    ``fraction``; the time per output token (a replica's speed, from which pools behind
    session affinity learn their capacity weights) when it moves by more than ``speed`` of
    the larger value. Capacity, format and served-model changes always count.
    """

    relative: float = 0.1
    requests: float = 1.0
    """Floor for waiting and running requests."""
    tokens: float = 256.0
    """Floor for pending tokens."""
    seconds: float = 0.02
    """Floor for the time to first token."""
    fraction: float = 0.05
    """Absolute band for KV-cache use and prefix hit rate."""
    speed: float = 0.25
    """Relative band for the time per output token: finer than the capacity ladder's
    steps (about 1.4x apart), coarser than the noise of one scrape interval."""

    def moved(self, last: TelemetryRecord, record: TelemetryRecord) -> bool:
        """True when `record` differs from `last` beyond the band (the time does not count)."""
        if (last.max_running, last.format) != (record.max_running, record.format):
            return True
        if (last.models, last.adapters, last.models_error) != (
            record.models,
            record.adapters,
            record.models_error,
        ):
            # What a replica serves decides where requests may go: every change counts.
            return True
        counts = (
            (last.waiting, record.waiting, self.requests),
            (last.running, record.running, self.requests),
            (last.pending_tokens, record.pending_tokens, self.tokens),
            (last.ttft, record.ttft, self.seconds),
        )
        for old, new, floor in counts:
            if (old is None) != (new is None):
                return True
            if old is not None and new is not None:
                change = abs(new - old)
                if change >= floor and change > self.relative * max(old, new):
                    return True
        if self.speed_moved(last, record):
            return True
        for old, new in (
            (last.kv_cache, record.kv_cache),
            (last.prefix_hit_rate, record.prefix_hit_rate),
        ):
            if (old is None) != (new is None):
                return True
            if old is not None and new is not None and abs(new - old) > self.fraction:
                return True
        return False

    def speed_moved(self, last: TelemetryRecord, record: TelemetryRecord) -> bool:
        """True when the time per output token, its mean or its median, moved beyond ``speed``
        (or the mean appeared or went). An agent writes the two records after such a move
        too, whatever they hold: the capacity weights wait for two slow records in a row
        before they act on a speed change. The median comes and goes with the traffic (it
        needs ``signals.telemetry.MEDIAN_MIN_OBSERVATIONS`` tokens between scrapes), so only a move of it
        counts."""
        old, new = last.time_per_output_token, record.time_per_output_token
        if old is None or new is None:
            if (old is None) != (new is None):
                return True
        elif abs(new - old) > self.speed * max(old, new):
            return True
        old, new = last.median_time_per_output_token, record.median_time_per_output_token
        return old is not None and new is not None and abs(new - old) > self.speed * max(old, new)


__all__ = ["WriteBand"]
