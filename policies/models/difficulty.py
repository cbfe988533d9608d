"""Virtual models: one model name that clients call, served by a small and a large target model
that Envoy chooses between per request by a difficulty score.

The score comes from a scorer chosen per virtual model (built in, evaluated by Envoy from
features of the request; the operator's classifier over HTTP; or a client header), and the
large model takes the requests that score highest. With ``share`` set, kvpilot moves the
threshold so the large model keeps that share of requests whatever the traffic mix; ``cap`` and
``floor`` bound the share in every Envoy whatever the scorer says (``signals.difficulty``).
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from policies.models.fields import Duration, HeaderName, Model
from policies.models.targets import DERIVED, Step, Target, derived, field_error, target_errors

FEATURES = (
    "promptTokens",
    "turns",
    "codeBlocks",
    "math",
    "questionWords",
    "maxTokens",
    "reasoningEffort",
)
"""Request features the built-in scorer weighs (``signals.difficulty.features`` computes them;
Envoy's Lua filter computes the same from the same body)."""

DEFAULT_WEIGHTS: dict[str, float] = {
    "promptTokens": 0.9,
    "turns": 0.15,
    "codeBlocks": 0.8,
    "math": 0.35,
    "questionWords": 0.45,
    "maxTokens": 0.25,
    "reasoningEffort": 0.7,
}
"""Weights shipped with kvpilot, before an operator fits their own (``kvpilot difficulty fit``):
longer, deeper, code and math heavy prompts that ask why or how and want long or reasoned
answers score higher."""
DEFAULT_BIAS = -7.0

DIFFICULTY_HEADER = "x-kvpilot-difficulty"
"""Default client header: ``easy``, ``hard`` or a score from 0 to 1."""


class BuiltinScorer(Model):
    """A linear model over request features, evaluated by Envoy; the score is its logistic."""

    weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_WEIGHTS),
        description="Weight of each feature: " + ", ".join(FEATURES) + ". A feature left out "
        "weighs 0. Default: kvpilot's shipped weights.",
    )
    bias: float = Field(DEFAULT_BIAS, description="Intercept of the linear model. Default: -7.")

    @field_validator("weights")
    @classmethod
    def _known(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - set(FEATURES))
        if unknown:
            raise ValueError(
                f"weights name unknown feature {unknown[0]!r}; features: {', '.join(FEATURES)}"
            )
        return value


SCORER_RESERVE_FLOOR = 0.003
"""Seconds of an external scorer's budget kept for the fixed cost of the call, at least: the
Lua's own work around ``httpCall`` and Envoy's resumption after it. Measured with Envoy 1.40
(``python -m bench.difficulty.luaprice --external``): a classifier that answers in 1 ms added
1.8 ms, one slower than the call's timeout added the timeout plus 2.8 ms (medians)."""
SCORER_RESERVE_SHARE = 0.10
"""Share of the budget kept for that cost when it is more than the floor: the cost grows with
the machine's load, and a larger budget can spare more of it."""
MIN_SCORER_BUDGET = 0.010
"""The smallest budget: it leaves the classifier 7 ms, a few of its round trips on a loaded
machine."""
MAX_SCORER_BUDGET = 10.0


def scorer_reserve(budget: float) -> float:
    """Seconds of ``budget`` kept for the fixed cost of calling the classifier."""
    return max(SCORER_RESERVE_FLOOR, SCORER_RESERVE_SHARE * budget)


def scorer_call_timeout(budget: float) -> float:
    """How long Envoy waits for the classifier's answer within ``budget``."""
    return budget - scorer_reserve(budget)


class ExternalScorer(Model):
    """The operator's classifier: Envoy POSTs the request body and reads ``{"score": 0..1}``."""

    url: str = Field(description="http://host:port/path of the classifier.")
    timeout: Duration = Field(
        0.05,
        description="Latency budget of the whole scoring step: what scoring may add to a "
        "request, the classifier's answer and Envoy's own work around the call together. "
        "Envoy waits for the answer this long less a reserve for that work (the larger of 3ms "
        "and 10%: a 50ms budget waits 45ms), then takes the fallback target. From 10ms to "
        "10s. Default: 50ms.",
    )
    fallback: Literal["small", "large"] = Field(
        "small",
        description="Target of requests the classifier does not score in time (down, slow, "
        "malformed answer). Default: small.",
    )

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError("url must be http://host[:port][/path]")
        if parts.port is None and ":" in parts.netloc.rsplit("]", 1)[-1]:
            raise ValueError("url has an invalid port")
        return value

    @field_validator("timeout")
    @classmethod
    def _budget(cls, value: float) -> float:
        if not MIN_SCORER_BUDGET <= value <= MAX_SCORER_BUDGET:
            raise ValueError(
                f"timeout is the scoring step's whole budget and must be from "
                f"{MIN_SCORER_BUDGET * 1000:g}ms to {MAX_SCORER_BUDGET:g}s: below "
                f"{MIN_SCORER_BUDGET * 1000:g}ms the reserve for Envoy's own work "
                f"({SCORER_RESERVE_FLOOR * 1000:g}ms at least) leaves the classifier too little"
            )
        return value

    @property
    def call_timeout(self) -> float:
        """Seconds Envoy waits for the classifier: the budget less the reserve."""
        return scorer_call_timeout(self.timeout)


EscalateOn = Literal["5xx", "reset", "connect-failure", "timeout"]
DEFAULT_ESCALATE_ON: tuple[EscalateOn, ...] = ("5xx", "reset", "connect-failure")


class Escalation(Model):
    """Retry a request the small model failed once on the large model, within the same client
    request. Envoy does it: the retry goes to the large model's pools with the body's
    ``model`` rewritten for them. A finish reason cannot trigger it: that is in the response
    body, which Envoy would have to hold back from a streaming client to read."""

    retry_on: list[EscalateOn] = Field(
        default_factory=lambda: list(DEFAULT_ESCALATE_ON),
        min_length=1,
        description="Failures of the small model that escalate: 5xx, reset, connect-failure, "
        "timeout (needs timeout above 0). Default: 5xx, reset, connect-failure.",
    )
    timeout: Duration = Field(
        0.0,
        description="Time the small model has before the request escalates (to the first "
        "response byte and beyond); 0 = the route's. Default: 0.",
    )

    @model_validator(mode="after")
    def _timeout(self) -> Escalation:
        if "timeout" in self.retry_on and not self.timeout:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "value_error", "escalating on timeout needs a timeout above 0"
                        ),
                        loc=("timeout",),
                        input=None,
                    )
                ],
            )
        return self


ScorerType = Literal["builtin", "external", "header"]


class Scorer(Model):
    """Where a request's difficulty score comes from."""

    type: ScorerType = Field(
        "builtin",
        description="builtin (features of the request, in Envoy), external (the operator's "
        "classifier) or header (the client's header alone). Default: builtin.",
    )
    builtin: BuiltinScorer = Field(
        default_factory=BuiltinScorer, description="Weights of the built-in scorer."
    )
    external: ExternalScorer | None = Field(None, description="The classifier, for type external.")
    header: HeaderName = Field(
        DIFFICULTY_HEADER,
        description="Client header that states the difficulty (easy, hard or a score from 0 "
        "to 1), honoured with every type; without it, type header scores 0. Default: "
        f"{DIFFICULTY_HEADER}.",
    )

    @model_validator(mode="after")
    def _external(self) -> Scorer:
        if self.type == "external" and self.external is None:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "value_error",
                            "type external needs this field (url, timeout, fallback)",
                        ),
                        loc=("external",),
                        input=None,
                    )
                ],
            )
        return self


class VirtualModel(Model):
    """A model name no pool serves; each request goes to one of its target models: ``small``
    or ``large``, or one of ``targets``."""

    name: str = Field(min_length=1, max_length=256, description="The name clients call.")
    small: str = Field(
        description="Model that takes easy requests; a route must serve it. With targets: "
        "the first target's model."
    )
    large: str = Field(
        description="Model that takes hard requests; a route must serve it. With targets: the "
        "last target's model."
    )
    targets: list[Target] | None = Field(
        None,
        min_length=2,
        description="Target models in order of difficulty, instead of small and large (which "
        "then follow from the first and the last, as share and threshold follow from the "
        "last). Each target after the first takes the requests that score above its threshold "
        "and below the next one's. Default: none (small and large).",
    )
    scorer: Scorer = Field(default_factory=Scorer, description="Where the score comes from.")
    share: float | None = Field(
        20.0,
        description="Percent of requests for the large model, held by kvpilot moving the "
        "threshold from the scores Envoys report. null: a fixed threshold. Default: 20.",
    )
    threshold: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Score above which a request goes to the large model, until kvpilot has "
        "learned the score distribution (or always, with share null). Default: 0.5.",
    )
    escalation: Escalation | None = Field(
        None,
        description="Retry the small model's failures once on the large model. Default: off.",
    )
    cap: float | None = Field(
        None,
        description="Percent of requests the large model (with targets: every target after "
        "the first, together) takes at most, in every Envoy, whatever the scorer says. "
        "Default: share + 10 (100 with share null).",
    )
    floor: float | None = Field(
        None,
        description="Percent of requests the large model (with targets: every target after "
        "the first, together) takes at least. Default: share - 10 (0 with share null).",
    )

    @field_validator("share", "cap", "floor")
    @classmethod
    def _percent(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 100:
            raise ValueError("must be a percent from 0 to 100")
        return value

    @model_validator(mode="before")
    @classmethod
    def _from_targets(cls, data: Any) -> Any:
        """With targets, small, large, share and threshold follow from them (a stored object
        that carries both agrees with itself)."""
        if not isinstance(data, dict) or not isinstance(data.get("targets"), list):
            return data
        implied = derived(data["targets"])
        if implied is None:
            return data
        for field in DERIVED:
            if field in data and data[field] != implied[field]:
                raise field_error(
                    (field,),
                    f"with targets, leave {field} out: it follows from the "
                    + ("first" if field == "small" else "last")
                    + " target",
                )
        return {**data, **implied}

    @model_validator(mode="after")
    def _check(self) -> VirtualModel:
        errors: list[tuple[tuple[str | int, ...], str]] = []
        if self.small == self.large:
            errors.append((("large",), "small and large must be different models"))
        if self.name in self.models:
            errors.append((("name",), "a virtual model cannot be its own target"))
        errors += target_errors(self.targets, self.steps) if self.targets else []
        if self.cap_percent < self.floor_percent:
            errors.append(
                (("cap",), f"cap ({self.cap_percent:g}) is below floor ({self.floor_percent:g})")
            )
        above = self.above_share
        if above is not None and not self.floor_percent <= above <= self.cap_percent:
            errors.append(
                (
                    ("targets",) if self.targets else ("share",),
                    f"share {above:g} is outside floor ({self.floor_percent:g}) and cap "
                    f"({self.cap_percent:g})",
                )
            )
        if errors:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError("value_error", message.replace("{", "{{")),
                        loc=field,
                        input=None,
                    )
                    for field, message in errors
                ],
            )
        return self

    @property
    def models(self) -> list[str]:
        """The target models, easiest first."""
        if self.targets:
            return [target.model for target in self.targets]
        return [self.small, self.large]

    @property
    def steps(self) -> list[Step]:
        """The targets after the first, in order, each with its threshold and the share of
        requests it and the later ones are held to."""
        if not self.targets:
            return [Step(self.large, self.threshold, self.share)]
        later = self.targets[1:]
        out = []
        for index, target in enumerate(later):
            threshold = target.threshold
            if threshold is None:
                threshold = (index + 1) / len(self.targets)
            above = None if target.share is None else sum(t.share or 0.0 for t in later[index:])
            out.append(Step(target.model, threshold, above))
        return out

    @property
    def above_share(self) -> float | None:
        """Percent of requests held for the targets after the first (None: fixed)."""
        return self.steps[0].above

    @property
    def cap_percent(self) -> float:
        """The cap with its default applied."""
        if self.cap is not None:
            return self.cap
        above = self.above_share
        return 100.0 if above is None else min(100.0, above + 10)

    @property
    def floor_percent(self) -> float:
        """The floor with its default applied."""
        if self.floor is not None:
            return self.floor
        above = self.above_share
        return 0.0 if above is None else max(0.0, above - 10)
