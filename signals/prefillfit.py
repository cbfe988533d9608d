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
A busy engine spends its time on steps: each costs a fixed part (reading the weights,
scheduling) plus a part for each sequence it decodes and each prompt token it prefills, so
over any stretch in which it was never idle

    seconds = a x steps + b x output tokens + p x prefilled tokens.

An output token at a full batch of ``B`` costs ``c = a / B + b`` (the step's fixed part is
shared by ``B`` sequences), and the weight is ``p / c``. Written in the terms wanted,

    seconds = c x output tokens + p x prefilled tokens + a x (steps - output tokens / B),

whose last term is nothing over a stretch of full decode steps. The engines' counters give
every count (``output_tokens_total``: vLLM's time-per-output-token count, one per token as
it is made; ``prefilled_tokens_total``: the prefix cache's queries less its hits;
``steps_total``: the count of vLLM's tokens-per-step histogram), and the records' times the
seconds. Least squares over stretches gives ``c``, ``p`` and ``a``. An engine that does not
export its steps gives only stretches of full batches, taken with the last term at
nothing; while that term does not vary apart from the others (every stretch full), the fit
is the two-term one, ``a`` left out.

Steps are what make the fit quick: a pool at 0.9 of its capacity is busy all the time and
full seldom. One simulated engine, its batch held at 30% to 110% of its slots and its
requests arriving as a stream, said its weight after 40-120 busy seconds at a batch of 32
(five seeds), within 0.88-1.04x of the truth, and after 40 s at 8; kept full and read
without its steps, it needed 300-600 s at 32 and 150-300 s at 8 (docs/cost-overflow.md).

- **Intervals of ``FIT_WINDOW`` seconds.** A prompt is counted when the engine admits it
  and output tokens as they are made, so over a second or two the counts and the time do
  not line up: one simulated engine at 32 kept full read 0.14 over 1 s intervals, 0.18-0.21
  over 2 s, 0.21-0.23 over 5 s and 0.21-0.25 over 10 s, where its true ratio is 0.244 (at 8:
  0.05, 0.07, 0.08, 0.09 against 0.086). Five seconds is the shortest that reads within
  about a tenth. An interval counts only if the replica was busy at every record read in it
  (``BUSY`` of its batch running with its steps counted, ``FULL`` without), its counters
  did not go back (a restart) and the records came no further apart than ``MAX_GAP``. An
  agent writes a record only when it moved beyond its band (``signals.writeband``: running
  by a tenth), so a replica with an eighth of its batch running cannot fall idle and come
  back between two records unseen, short of a scrape interval; an idle gap shorter than
  that adds seconds no count explains, which the screen below leaves out when it is large.
- **A burst admitted is screened out.** Many prompts admitted at once (a queue let into a
  batch that emptied) are counted in the interval that admits them and prefilled in the
  next ones: one interval reads seconds of prefill it did not do and the next does seconds
  it did not count. Once the fit can say, an interval further from it than ``SCREEN``
  standard deviations of its residuals (or ``SCREEN_FLOOR`` of its time, whichever is more)
  is left out; ``RESTART_AFTER`` such intervals in a row mean the engine changed (a new
  model, another batch size), and the fit starts again from the last of them. Bursts of
  twenty and more prompts widen the residuals the screen measures against, so it catches
  the smaller ones: a simulated engine at 32 fed such bursts read 0.8-0.9x of its ratio
  (docs/cost-overflow.md).
- **Used once it is known.** The weight is the fit's once ``MIN_FIT_WINDOWS`` intervals are
  in it, the token counts are not in one fixed proportion (``MIN_SPREAD``), both costs are
  positive, and the fit's own standard error of the ratio (from its residuals) is within
  ``MAX_ERROR`` of it; until then the constant ``PREFILL_WEIGHT``.
- **It follows the engines.** Older intervals fade by ``DECAY`` per new one (about the last
  70 count), so a new model or a changed batch size moves the weight within minutes.
- **Bounded.** ``MIN_WEIGHT`` to ``MAX_WEIGHT``: prefill is compute-bound and parallel
  across a prompt's tokens, decode at a full batch memory-bound, so a prefilled token costs
  less than an output token on any engine measured here; outside the bounds the fit is read
  as noise and clamped.

Intervals are pooled over the route's owned replicas (one pool: one kind of engine, one
batch size).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from signals.overflowwork import FULL, PREFILL_WEIGHT, ReplicaLoad

FIT_WINDOW = 5.0
"""Seconds of a busy batch an interval of the fit spans, at least."""
MAX_GAP = 5.0
"""Most seconds between two records of one interval: a longer gap may hide a time the
replica was idle."""
BUSY = 0.125
"""Running share of its batch at or above which a replica that counts its steps is busy
(with ``BUSY_SEQUENCES`` at least)."""
BUSY_SEQUENCES = 2
"""Fewest running sequences per engine at which a replica that counts its steps is busy:
with one, a gap between two requests may leave it idle between two scrapes."""
MIN_FIT_WINDOWS = 8
"""Intervals the fit needs before its weight is used."""
MIN_SPREAD = 0.05
"""Least ``1 - r^2`` (uncentred) of a count on the others for the fit to tell its cost
apart: output and prefilled tokens that moved in one proportion give no weight, steps that
moved with them give the two-term fit."""
DECAY = 0.985
"""Weight an interval keeps each time a newer one is added."""
MAX_ERROR = 0.15
"""Largest relative standard error of the fit's weight that is used. Where prefill is a
third of the engines' time, 15% on the weight is about 5% on the capacity read."""
SCREEN = 4.0
"""Standard deviations of the fit's residuals beyond which a new interval is left out."""
SCREEN_FLOOR = 0.02
"""Least residual, as a share of the interval's seconds, that leaves an interval out (a fit
that is all but exact has residuals of nothing)."""
RESTART_AFTER = 4
"""Intervals left out in a row after which the fit starts again."""
MIN_WEIGHT = 0.01
MAX_WEIGHT = 1.0


Matrix = list[list[float]]


def _inverse(matrix: Matrix) -> Matrix | None:
    """The inverse of a small square matrix (Gauss-Jordan with partial pivoting), or None
    when it is singular."""
    size = len(matrix)
    rows = [[*row, *(1.0 if i == j else 0.0 for j in range(size))] for i, row in enumerate(matrix)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda row: abs(rows[row][column]))
        if rows[pivot][column] == 0.0:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        lead = rows[column][column]
        rows[column] = [value / lead for value in rows[column]]
        for row in range(size):
            if row != column and rows[row][column]:
                factor = rows[row][column]
                rows[row] = [v - factor * w for v, w in zip(rows[row], rows[column], strict=True)]
    return [row[size:] for row in rows]


class Solution(NamedTuple):
    """A least-squares fit of the intervals: ``c`` seconds per output token at a full batch,
    ``p`` per prefilled token, ``a`` per step (0 in the two-term fit), the covariance of
    the estimates over the residuals' variance (``c``, ``p``, then ``a`` when fitted: the
    inverse of the sums' matrix) and that variance."""

    c: float
    p: float
    a: float
    covariance: Matrix
    variance: float

    def predict(self, output: float, prefilled: float, extra: float) -> float:
        """The seconds the fit gives an interval of these counts."""
        return self.c * output + self.p * prefilled + self.a * extra

    def error(self) -> float:
        """The relative standard error of ``p / c`` (to first order)."""
        cov = self.covariance
        var_c, var_p, cov_cp = (self.variance * cov[i][j] for i, j in ((0, 0), (1, 1), (0, 1)))
        c, p = self.c, self.p
        # Var(p / c) / (p / c)^2 = var_p / p^2 + var_c / c^2 - 2 cov / (p c).
        return math.sqrt(max(0.0, var_p / (p * p) + var_c / (c * c) - 2 * cov_cp / (p * c)))


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """Least squares of seconds on output tokens, prefilled tokens and extra steps (steps
    beyond those of full decode batches) over busy intervals: the decayed sums, and how many
    intervals went in or were left out."""

    intervals: int = 0
    """Intervals added since the fit (last) started."""
    windows: float = 0.0
    """Their decayed count (about ``1 / (1 - DECAY)`` at most)."""
    screened: int = 0
    """Intervals left out as too far from the fit, ever."""
    in_row: int = 0
    """Of them, the last ones in a row."""
    oo: float = 0.0
    op: float = 0.0
    pp: float = 0.0
    ou: float = 0.0
    pu: float = 0.0
    uu: float = 0.0
    to: float = 0.0
    tp: float = 0.0
    tu: float = 0.0
    tt: float = 0.0
    stored: bool = False
    """Read back from etcd (``restore``) and not added to since: what another run of
    kvpilot learned."""

    def add(
        self, seconds: float, output: float, prefilled: float, extra: float = 0.0
    ) -> PrefillFit:
        """The fit with one more interval (`extra`: its steps less its output tokens over
        the batch size; 0 for a full interval of an engine without a steps count), older
        ones faded by ``DECAY``."""
        d = DECAY if self.windows else 1.0
        return replace(
            self,
            intervals=self.intervals + 1,
            windows=self.windows * d + 1.0,
            in_row=0,
            stored=False,
            oo=self.oo * d + output * output,
            op=self.op * d + output * prefilled,
            pp=self.pp * d + prefilled * prefilled,
            ou=self.ou * d + output * extra,
            pu=self.pu * d + prefilled * extra,
            uu=self.uu * d + extra * extra,
            to=self.to * d + seconds * output,
            tp=self.tp * d + seconds * prefilled,
            tu=self.tu * d + seconds * extra,
            tt=self.tt * d + seconds * seconds,
        )

    def take(
        self, seconds: float, output: float, prefilled: float, extra: float = 0.0
    ) -> PrefillFit:
        """``add``, unless the fit can say and the interval is further from it than
        ``SCREEN`` standard deviations (or ``SCREEN_FLOOR`` of its seconds): then it is left
        out, and after ``RESTART_AFTER`` in a row the fit starts again from it."""
        solution = self.solve()
        if solution is None:
            return self.add(seconds, output, prefilled, extra)
        residual = abs(seconds - solution.predict(output, prefilled, extra))
        if residual <= SCREEN * max(math.sqrt(solution.variance), SCREEN_FLOOR * seconds):
            return self.add(seconds, output, prefilled, extra)
        if self.in_row + 1 >= RESTART_AFTER:
            return PrefillFit(screened=self.screened + 1).add(seconds, output, prefilled, extra)
        return replace(self, screened=self.screened + 1, in_row=self.in_row + 1)

    def solve(self) -> Solution | None:
        """The least-squares costs, three terms when the extra steps vary apart from the
        token counts (``MIN_SPREAD``), else two; None without ``MIN_FIT_WINDOWS`` intervals
        or while the token counts moved in one proportion."""
        if self.intervals < MIN_FIT_WINDOWS or self.oo <= 0 or self.pp <= 0:
            return None
        tokens = self.oo * self.pp - self.op * self.op
        if tokens <= MIN_SPREAD * self.oo * self.pp:
            return None
        gram = [[self.oo, self.op], [self.op, self.pp]]
        moments = [self.to, self.tp]
        if self.uu > 0:
            # The extra steps' variance left once the token counts explain what they can.
            left = (
                self.uu
                - (
                    self.pp * self.ou * self.ou
                    - 2 * self.op * self.ou * self.pu
                    + self.oo * self.pu**2
                )
                / tokens
            )
            if left > MIN_SPREAD * self.uu:
                gram = [
                    [self.oo, self.op, self.ou],
                    [self.op, self.pp, self.pu],
                    [self.ou, self.pu, self.uu],
                ]
                moments.append(self.tu)
        inverse = _inverse(gram)
        if inverse is None:
            return None
        coefficients = [sum(i * m for i, m in zip(row, moments, strict=True)) for row in inverse]
        fitted = sum(c * m for c, m in zip(coefficients, moments, strict=True))
        # Residual sum of squares: tt - 2 b.m + b' G b, and G b = m at the solution.
        residual = max(0.0, self.tt - fitted)
        dof = self.windows - len(moments)
        variance = residual / dof if dof > 0 else 0.0
        c, p, *rest = coefficients
        return Solution(c, p, rest[0] if rest else 0.0, inverse, variance)

    def _physical(self) -> Solution | None:
        """``solve``'s solution when both costs are positive, else None."""
        solution = self.solve()
        if solution is None or solution.c <= 0 or solution.p <= 0:
            return None
        return solution

    def costs(self) -> tuple[float, float] | None:
        """(seconds per output token at a full batch, seconds per prefilled token), or None
        while the fit cannot say (too few intervals, counts in one proportion, a cost at or
        below zero)."""
        solution = self._physical()
        return None if solution is None else (solution.c, solution.p)

    def weight(self) -> float | None:
        """The learned weight (``p / c``, within ``MIN_WEIGHT`` and ``MAX_WEIGHT``), or None
        while the fit cannot say it to within ``MAX_ERROR``."""
        solution = self._physical()
        if solution is None or solution.error() > MAX_ERROR:
            return None
        return round(min(MAX_WEIGHT, max(MIN_WEIGHT, solution.p / solution.c)), 4)


class Opened(NamedTuple):
    """A replica's interval being read: when it started, its counts then (steps None: the
    engine does not count them) and the time of the last record read in it."""

    start: float
    output: float
    prefilled: float
    steps: float | None
    last: float


Starts = Mapping[str, Opened]
"""Replica key -> its open interval."""


def _busy(replica: ReplicaLoad) -> bool:
    """True when the replica's record says it was stepping all along: an eighth of its batch
    running (two sequences an engine at least) when it counts its steps, a full batch when
    it does not (and then only full stretches are taken)."""
    if replica.steps is None:
        return replica.running >= FULL
    return (
        replica.running >= BUSY
        and replica.running * replica.slots >= BUSY_SEQUENCES * replica.engines
    )


def fit_intervals(
    replicas: Sequence[ReplicaLoad], starts: Starts, fit: PrefillFit
) -> tuple[dict[str, Opened], PrefillFit]:
    """(the intervals open after this round, the fit with those that closed): each replica
    busy at its record, with its token counters, extends its interval; one that spans
    ``FIT_WINDOW`` goes to the fit (``PrefillFit.take``) and a new one starts where it
    ended. A replica not busy, without counters, with counters that went back, that began
    or stopped counting its steps, or read ``MAX_GAP`` after its last record starts
    again."""
    out: dict[str, Opened] = {}
    for replica in replicas:
        at, output, prefilled, steps = replica.at, replica.total, replica.prefilled, replica.steps
        if not _busy(replica) or at is None or output is None or prefilled is None:
            continue
        here = Opened(at, output, prefilled, steps, at)
        begun = starts.get(replica.key)
        if begun is None:
            out[replica.key] = here
            continue
        if at == begun.last:
            out[replica.key] = begun
            continue
        if (
            at - begun.last > MAX_GAP
            or at < begun.last
            or output < begun.output
            or prefilled < begun.prefilled
            or (steps is None) != (begun.steps is None)
            or (steps is not None and begun.steps is not None and steps < begun.steps)
        ):
            out[replica.key] = here
            continue
        if at - begun.start < FIT_WINDOW:
            out[replica.key] = begun._replace(last=at)
            continue
        made = output - begun.output
        extra = 0.0
        if steps is not None and begun.steps is not None and replica.slots > 0:
            # Several engines (data-parallel) step side by side, each at its own batch:
            # their seconds and counts add up to the same costs, the ratio unchanged.
            extra = (steps - begun.steps) - made / (replica.slots / replica.engines)
        fit = fit.take(at - begun.start, made, prefilled - begun.prefilled, extra)
        out[replica.key] = here
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
    """Where ``route_weight`` comes from: ``set``, ``learned`` (`fit` can say), ``stored``
    (it can, read back from etcd and not yet added to) or ``default`` (``PREFILL_WEIGHT``,
    until it can)."""
    if fixed is not None:
        return "set"
    if fit.weight() is None:
        return "default"
    return "stored" if fit.stored else "learned"


__all__ = [
    "BUSY",
    "BUSY_SEQUENCES",
    "DECAY",
    "FIT_WINDOW",
    "MAX_ERROR",
    "MAX_GAP",
    "MAX_WEIGHT",
    "MIN_FIT_WINDOWS",
    "MIN_SPREAD",
    "MIN_WEIGHT",
    "RESTART_AFTER",
    "SCREEN",
    "SCREEN_FLOOR",
    "Opened",
    "PrefillFit",
    "Solution",
    "Starts",
    "fit_intervals",
    "route_weight",
    "weight_source",
]
