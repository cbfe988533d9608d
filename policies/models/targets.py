"""A virtual model's targets when it has more than a small and a large one: the list in order
of difficulty, the steps the share loop holds, and what is wrong with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from policies.models.fields import Model


class Target(Model):
    """One of a virtual model's target models, in order of difficulty: the first takes the
    easiest requests, each later one harder ones."""

    model: str = Field(min_length=1, description="A model some route's match.models names.")
    share: float | None = Field(
        None,
        description="Percent of requests for this target, held by kvpilot (targets after the "
        "first; the first takes the rest). Set it on every later target, or on none for fixed "
        "thresholds. Default: none.",
    )
    threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Score above which a request goes to this target or a later one, until "
        "kvpilot has learned the scores (or always, without shares). Targets after the first; "
        "ascending. Default: evenly spaced (1/3 and 2/3 for three targets).",
    )

    @field_validator("share")
    @classmethod
    def _percent(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 100:
            raise ValueError("must be a percent from 0 to 100")
        return value


@dataclass(frozen=True, slots=True)
class Step:
    """A target after the first, with what it is held to."""

    model: str
    threshold: float
    """Its configured threshold: scores above it go to this target or a later one."""
    above: float | None
    """Percent of requests for this target and every later one (None: fixed thresholds)."""


DERIVED = ("small", "large", "share", "threshold")


def field_error(field: tuple[str | int, ...], message: str) -> ValidationError:
    """A validation error of a virtual model at ``field``, with the message a user reads."""
    return ValidationError.from_exception_data(
        "VirtualModel",
        [
            InitErrorDetails(
                type=PydanticCustomError("value_error", message.replace("{", "{{")),
                loc=field,
                input=None,
            )
        ],
    )


def derived(targets: list[Any]) -> dict[str, Any] | None:
    """small, large, share and threshold as the two-target spelling would state them."""
    items = [t.model_dump() if isinstance(t, Model) else t for t in targets]
    if len(items) < 2 or not all(isinstance(t, dict) for t in items):
        return None
    last = items[-1]
    threshold = last.get("threshold")
    return {
        "small": items[0].get("model"),
        "large": last.get("model"),
        "share": last.get("share"),
        "threshold": threshold if threshold is not None else (len(items) - 1) / len(items),
    }


def target_errors(
    targets: list[Target], steps: list[Step]
) -> list[tuple[tuple[str | int, ...], str]]:
    """What is wrong with a virtual model's targets, each with the path of the field at fault."""
    errors: list[tuple[tuple[str | int, ...], str]] = []
    first = targets[0]
    for field in ("share", "threshold"):
        if getattr(first, field) is not None:
            errors.append(
                (
                    ("targets", 0, field),
                    f"the first target takes what the others leave: leave {field} out",
                )
            )
    models = [target.model for target in targets]
    for index, model in enumerate(models):
        if model in models[:index]:
            errors.append((("targets", index, "model"), f"{model!r} is a target twice"))
    later = targets[1:]
    shares = [target.share for target in later]
    if any(share is None for share in shares) and any(share is not None for share in shares):
        index = 1 + shares.index(None)
        errors.append(
            (
                ("targets", index, "share"),
                "set share on every target after the first, or on none",
            )
        )
    elif shares[0] is not None and sum(s or 0.0 for s in shares) > 100:
        errors.append((("targets",), "the targets' shares add up to more than 100"))
    for index in range(1, len(steps)):
        if steps[index].threshold <= steps[index - 1].threshold:
            errors.append(
                (
                    ("targets", index + 1, "threshold"),
                    f"thresholds must ascend: {steps[index].threshold:g} is not above "
                    f"{steps[index - 1].threshold:g}",
                )
            )
    return errors
