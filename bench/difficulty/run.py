"""Run the difficulty benchmark: routing policies for a virtual model, compared on the same
prompts, over a sweep of large-model shares and several seeds.

Policies (each at a target share of large-model calls, except the two fixed ones):

- ``all_small``, ``all_large``: every request to one model;
- ``random``: the share picked at random, knowing nothing;
- ``builtin``: Envoy's built-in scorer with kvpilot's shipped weights;
- ``fitted``: the same scorer with weights fitted by ``kvpilot difficulty fit`` on a separate
  labelled draw of the same traffic (what an operator with labels would deploy);
- ``oracle``: knows which prompts the small model fails and sends those first.

Scored policies run through the share loop as it runs in production: scores arrive at
``RATE`` requests per second, ``signals.difficultyshare.ShareController`` moves the threshold
from what it saw, Envoy applies it two seconds later, and each worker's cap and floor
(``ShareGuard``) hold, so the share a policy reaches is the loop's, not an offline quantile.
The scores are the Python twin of Envoy's Lua (tests hold the two equal to four decimals).

Cost and TTFT come from a price and a latency model of the two models (``Models``), stated in
the report: this benchmark measures how well the choice is made, not the models.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from bench.difficulty.prompts import Prompt, PromptMix, generate, labelled_lines
from policies.models import DEFAULT_BIAS, DEFAULT_WEIGHTS
from signals.difficulty import score
from signals.difficultyfit import fit, read_rows
from signals.difficultyshare import ShareController, ShareGuard, chooses_large

RATE = 50
"""Requests per second of the simulated stream."""
LAG = 2
"""Seconds between a decision in kvpilot and its threshold in force in Envoy."""


@dataclass(frozen=True, slots=True)
class Models:
    """Price and latency of the small and the large model (per million tokens, seconds)."""

    small_price: float = 0.2
    large_price: float = 1.0
    small_ttft_base: float = 0.04
    small_ttft_per_token: float = 0.00004
    large_ttft_base: float = 0.12
    large_ttft_per_token: float = 0.00020


@dataclass(frozen=True, slots=True)
class DifficultyConfig:
    """One benchmark run."""

    seeds: tuple[int, ...] = (1, 2, 3)
    prompts: int = 4000
    training: int = 2000
    shares: tuple[float, ...] = (5, 10, 20, 30, 40, 60, 80)
    mix: PromptMix = field(default_factory=PromptMix)
    models: Models = field(default_factory=Models)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one policy did with one seed's prompts."""

    policy: str
    target: float
    """Target share in percent (NaN-free: 0 and 100 for the fixed policies)."""
    seed: int
    large_share: float
    quality: float
    """Percent of requests whose answer was good."""
    cost: float
    """Dollars for the whole run at the models' prices."""
    ttft_mean: float
    ttft_p99: float


def _stream(prompts: list[Prompt], scores: list[float], share: float, seed: int) -> list[bool]:
    """Large or not for each prompt, through the share loop (controller, lag, guard)."""
    rng = random.Random(seed)
    controller = ShareController(share, 0.5)
    guard = ShareGuard(min(100.0, share + 10), max(0.0, share - 10))
    threshold, tie = 0.5, 0.0
    pending: list[tuple[float, float]] = []
    out = []
    for index, value in enumerate(scores):
        at = index / RATE
        out.append(guard.admit(chooses_large(value, threshold, tie, rng.random())))
        controller.observe(at, value)
        if (index + 1) % RATE == 0:
            decision = controller.decide(at)
            pending.append((decision.threshold, decision.tie))
            if len(pending) >= LAG:
                threshold, tie = pending.pop(0)
    return out


def _oracle(prompts: list[Prompt], share: float, seed: int) -> list[bool]:
    """The prompts the small model fails first, then others at random, up to the share."""
    rng = random.Random(seed)
    budget = round(share / 100 * len(prompts))
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i].small_ok, rng.random()))
    chosen = set(order[:budget])
    return [i in chosen for i in range(len(prompts))]


def _random(prompts: list[Prompt], share: float, seed: int) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < share / 100 for _ in prompts]


def measure(
    policy: str, target: float, seed: int, prompts: list[Prompt], large: list[bool], models: Models
) -> Outcome:
    """Quality, cost and TTFT of one assignment of prompts to models."""
    good = sum(1 for p, big in zip(prompts, large, strict=True) if big or p.small_ok)
    cost = 0.0
    ttfts = []
    for p, big in zip(prompts, large, strict=True):
        tokens = p.prompt_tokens + p.output_tokens
        if big:
            cost += tokens * models.large_price / 1e6
            ttfts.append(models.large_ttft_base + p.prompt_tokens * models.large_ttft_per_token)
        else:
            cost += tokens * models.small_price / 1e6
            ttfts.append(models.small_ttft_base + p.prompt_tokens * models.small_ttft_per_token)
    ttfts.sort()
    return Outcome(
        policy=policy,
        target=target,
        seed=seed,
        large_share=100 * sum(large) / len(large),
        quality=100 * good / len(prompts),
        cost=cost,
        ttft_mean=statistics.fmean(ttfts),
        ttft_p99=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    )


def run_seed(config: DifficultyConfig, seed: int) -> tuple[list[Outcome], dict[str, float]]:
    """Every policy on one seed's prompts; also the fitted scorer's held-out ROC AUC."""
    prompts = generate(config.prompts, config.mix, seed)
    training = generate(config.training, config.mix, seed + 10_000)
    fitted = fit(read_rows(labelled_lines(training)))
    bodies = [p.encoded() for p in prompts]
    scorers: dict[str, Callable[[bytes], float]] = {
        "builtin": lambda body: score(DEFAULT_WEIGHTS, DEFAULT_BIAS, body),
        "fitted": lambda body: score(fitted.weights, fitted.bias, body),
    }
    scores = {name: [scorer(body) for body in bodies] for name, scorer in scorers.items()}
    models = config.models
    out = [
        measure("all_small", 0, seed, prompts, [False] * len(prompts), models),
        measure("all_large", 100, seed, prompts, [True] * len(prompts), models),
    ]
    for share in config.shares:
        out.append(measure("random", share, seed, prompts, _random(prompts, share, seed), models))
        out.append(measure("oracle", share, seed, prompts, _oracle(prompts, share, seed), models))
        for name, values in scores.items():
            large = _stream(prompts, values, share, seed)
            out.append(measure(name, share, seed, prompts, large, models))
    return out, {"fitted_auc": fitted.auc, "fitted_training_rows": float(fitted.trained)}


def run_difficulty(config: DifficultyConfig) -> dict[str, object]:
    """All seeds; the raw outcomes and the fits, ready for the report."""
    outcomes: list[Outcome] = []
    fits = {}
    for seed in config.seeds:
        seed_outcomes, fitted = run_seed(config, seed)
        outcomes.extend(seed_outcomes)
        fits[seed] = fitted
    return {
        "config": asdict(config),
        "outcomes": [asdict(o) for o in outcomes],
        "fits": fits,
    }
