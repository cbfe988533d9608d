"""What a prefilled token costs against an output token, learned from the engines' own
counters (pure, no I/O): the weight of overflow's unit of work (``signals.overflowwork``).

Why learn it
------------
Overflow counts demand and capacity in work: output tokens plus uncached prompt tokens at a
weight. The right weight is the engine's: the time a prompt token takes to prefill over the
time an output token takes at a full batch. That ratio is not a constant. A decode step
costs about the same whether it holds 8 sequences or 32 (it reads the weights once), so an
output token gets cheaper as the batch grows while a prefilled token costs the same compute:
the benchmark's simulated engine is at 0.086 at batches of 8 and 0.24 at 32, and a GPU's
ratio depends on the model, the card and the engine's settings. With the constant of 0.1 at
32, documents (long prompts) counted for less work than they cost, the owned replicas'
capacity read high and the paid pools got less than the excess (docs/cost-overflow.md,
"Measured at a batch of 32").

How
---
A full engine is never idle: over an interval its time goes to decode steps and prefill,

    seconds = c x output tokens + p x prefilled tokens,

with ``c`` the time of an output token at a full batch and ``p`` that of a prefilled one.
The engines' counters give both token counts (``output_tokens_total``: vLLM's
time-per-output-token count, one per token as it is made; ``prefilled_tokens_total``: the
prefix cache's queries less its hits), and the records' times give the seconds. Over
intervals in which a replica stayed full, least squares gives ``c`` and ``p``; the weight
is ``p / c``. The fit needs the mix to move between intervals (more documents in one, more
conversation turns in another), which a Poisson stream of long prompts does on its own.

- **Intervals of ``FIT_WINDOW`` seconds.** A prompt is counted when the engine admits it
  and output tokens as they are made, so over a second or two the counts and the time do
  not line up: one simulated engine at 32 kept full read 0.14 over 1 s intervals, 0.18-0.21
  over 2 s, 0.21-0.23 over 5 s and 0.21-0.25 over 10 s, where its true ratio is 0.244 (at 8:
  0.05, 0.07, 0.08, 0.09 against 0.086). Five seconds is the shortest that reads within
  about a tenth, and the batches of a pool near its capacity stay full that long more often than
  ten. An interval counts only if the replica was full at every record read in it
  (``FULL`` of its batch), its counters did not go back (a restart) and the records came no
  further apart than ``MAX_GAP``. An agent writes a record only when it moved beyond its
  band (``signals.writeband``), so between two full records the batch may have dipped by a
  few sequences: the engine was busy all along, which is what the time identity needs.
- **Used once it is known.** The weight is the fit's once ``MIN_FIT_WINDOWS`` intervals are
  in it, the token counts are not in one fixed proportion (``MIN_SPREAD``), both costs are
  positive, and the fit's own standard error of the ratio (from its residuals) is within
  ``MAX_ERROR`` of it; until then the constant ``PREFILL_WEIGHT``. A simulated engine kept
  full reached that after 150-300 s of full batches at 8 and 300-600 s at 32 (its
  intervals alone; a pool's replicas pool theirs), reading 0.077-0.089 (true 0.086) and 0.218-0.237
  (true 0.244); eight intervals alone read anywhere from 0.02 to 0.22 at 8.
- **It follows the engines.** Older intervals fade by ``DECAY`` per new one (about the last
  70 count), so a new model or a changed batch size moves the weight within minutes.
- **Bounded.** ``MIN_WEIGHT`` to ``MAX_WEIGHT``: prefill is compute-bound and parallel
  across a prompt's tokens, decode at a full batch memory-bound, so a prefilled token costs
  less than an output token on any engine measured here; outside the bounds the fit is read
  as noise and clamped.

Intervals are pooled over the route's owned replicas (one pool: one kind of engine).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from signals.overflowwork import FULL, PREFILL_WEIGHT, ReplicaLoad

FIT_WINDOW = 5.0
"""Seconds of full batch an interval of the fit spans, at least."""
MAX_GAP = 5.0
"""Most seconds between two records of one interval: a longer gap may hide a time the
replica was idle."""
MIN_FIT_WINDOWS = 8
"""Intervals the fit needs before its weight is used."""
MIN_SPREAD = 0.05
"""Least ``1 - r^2`` of the intervals' output and prefill counts (uncentred): below it they
moved in one proportion and the fit cannot tell their costs apart."""
DECAY = 0.985
"""Weight an interval keeps each time a newer one is added."""
MAX_ERROR = 0.15
"""Largest relative standard error of the fit's weight that is used. Where prefill is a
third of the engines' time, 15% on the weight is about 5% on the capacity read."""
MIN_WEIGHT = 0.01
MAX_WEIGHT = 1.0


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """Least squares of seconds on output and prefilled tokens over full intervals: the
    decayed sums, and how many intervals went in."""

    intervals: int = 0
    """Intervals added, ever."""
    windows: float = 0.0
    """Their decayed count (about ``1 / (1 - DECAY)`` at most)."""
    oo: float = 0.0
    op: float = 0.0
    pp: float = 0.0
    to: float = 0.0
    tp: float = 0.0
    tt: float = 0.0

    def add(self, seconds: float, output: float, prefilled: float) -> PrefillFit:
        """The fit with one more interval, older ones faded by ``DECAY``."""
        d = DECAY if self.windows else 1.0
        return PrefillFit(
            intervals=self.intervals + 1,
            windows=self.windows * d + 1.0,
            oo=self.oo * d + output * output,
            op=self.op * d + output * prefilled,
            pp=self.pp * d + prefilled * prefilled,
            to=self.to * d + seconds * output,
            tp=self.tp * d + seconds * prefilled,
            tt=self.tt * d + seconds * seconds,
        )

    def costs(self) -> tuple[float, float] | None:
        """(seconds per output token, seconds per prefilled token) at a full batch, or None
        while the fit cannot say (too few intervals, counts in one proportion, a cost at or
        below zero)."""
        if self.intervals < MIN_FIT_WINDOWS or self.oo <= 0 or self.pp <= 0:
            return None
        det = self.oo * self.pp - self.op * self.op
        if det <= MIN_SPREAD * self.oo * self.pp:
            return None
        output = (self.to * self.pp - self.tp * self.op) / det
        prefill = (self.tp * self.oo - self.to * self.op) / det
        if output <= 0 or prefill <= 0:
            return None
        return output, prefill

    def error(self) -> float | None:
        """The relative standard error of ``p / c`` (the fit's residuals, to first order),
        or None without a fit."""
        costs = self.costs()
        if costs is None or self.windows <= 2:
            return None
        c, p = costs
        residual = (
            self.tt
            - 2 * (c * self.to + p * self.tp)
            + c * c * self.oo
            + 2 * c * p * self.op
            + p * p * self.pp
        )
        variance = max(0.0, residual) / (self.windows - 2)
        det = self.oo * self.pp - self.op * self.op
        var_c, var_p, cov = (
            variance * self.pp / det,
            variance * self.oo / det,
            -variance * self.op / det,
        )
        # Var(p / c) / (p / c)^2 = var_p / p^2 + var_c / c^2 - 2 cov / (p c).
        relative = var_p / (p * p) + var_c / (c * c) - 2 * cov / (p * c)
        return math.sqrt(max(0.0, relative))

    def weight(self) -> float | None:
        """The learned weight (``p / c``, within ``MIN_WEIGHT`` and ``MAX_WEIGHT``), or None
        while the fit cannot say it to within ``MAX_ERROR``."""
        costs = self.costs()
        error = self.error()
        if costs is None or error is None or error > MAX_ERROR:
            return None
        return round(min(MAX_WEIGHT, max(MIN_WEIGHT, costs[1] / costs[0])), 4)


Starts = Mapping[str, tuple[float, float, float, float]]
"""Replica key -> (when its current interval started, its output tokens and prefilled
tokens then, the time of the last record read in it)."""


def fit_intervals(
    replicas: Sequence[ReplicaLoad], starts: Starts, fit: PrefillFit
) -> tuple[dict[str, tuple[float, float, float, float]], PrefillFit]:
    """(the intervals open after this round, the fit with those that closed): each replica
    full at its record, with both counters, extends its interval; one that spans
    ``FIT_WINDOW`` is added to the fit and a new one starts where it ended. A replica not
    full, without counters, with counters that went back, or read ``MAX_GAP`` after its
    last record starts again."""
    out: dict[str, tuple[float, float, float, float]] = {}
    for replica in replicas:
        at, output, prefilled = replica.at, replica.total, replica.prefilled
        if replica.running < FULL or at is None or output is None or prefilled is None:
            continue
        begun = starts.get(replica.key)
        if begun is None:
            out[replica.key] = (at, output, prefilled, at)
            continue
        start, output0, prefilled0, last = begun
        if at == last:
            out[replica.key] = begun
            continue
        if at - last > MAX_GAP or output < output0 or prefilled < prefilled0 or at < last:
            out[replica.key] = (at, output, prefilled, at)
            continue
        if at - start >= FIT_WINDOW:
            fit = fit.add(at - start, output - output0, prefilled - prefilled0)
            out[replica.key] = (at, output, prefilled, at)
        else:
            out[replica.key] = (start, output0, prefilled0, at)
    return out, fit


def route_weight(fit: PrefillFit | None, fixed: float | None = None) -> float:
    """The weight a route's overflow counts a prefilled token at: `fixed` (its
    ``overflow.prefillWeight``) when set, else the fit's, or ``PREFILL_WEIGHT`` until it can
    say."""
    if fixed is not None:
        return fixed
    weight = fit.weight() if fit is not None else None
    return PREFILL_WEIGHT if weight is None else weight


def weight_source(fit: PrefillFit, fixed: float | None) -> str:
    """Where ``route_weight`` comes from: ``set``, ``learned`` (`fit` can say) or
    ``default`` (``PREFILL_WEIGHT``, until it can)."""
    if fixed is not None:
        return "set"
    return "learned" if fit.weight() is not None else "default"


__all__ = [
    "DECAY",
    "FIT_WINDOW",
    "MAX_ERROR",
    "MAX_GAP",
    "MAX_WEIGHT",
    "MIN_FIT_WINDOWS",
    "MIN_SPREAD",
    "MIN_WEIGHT",
    "PrefillFit",
    "Starts",
    "fit_intervals",
    "route_weight",
    "weight_source",
]
