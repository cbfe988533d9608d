"""A RoutingPolicy's spec: the listener, the fleets it reaches, its routes and its service
classes, with the checks that span routes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from policies.models.classes import ServiceClasses
from policies.models.difficulty import VirtualModel
from policies.models.fields import HeaderName, Model, Name
from policies.models.route import Route


class ListenerSpec(Model):
    """Where Envoy accepts client traffic."""

    address: str = Field("0.0.0.0", description="Bind address. Default: 0.0.0.0.")
    port: int = Field(10000, ge=1, le=65535, description="Port. Default: 10000.")


class RoutingPolicySpec(Model):
    """How requests reaching a listener are routed to pools."""

    fleets: list[Name | Literal["*"]] = Field(
        default_factory=lambda: ["default"],
        description="Envoy fleets (node.cluster) that receive this policy; '*' for all. "
        "Default: [default].",
    )
    listener: ListenerSpec = Field(
        default_factory=ListenerSpec, description="Listener address and port."
    )
    hosts: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Host (authority) names this policy answers for. Default: ['*'].",
    )
    model_header: HeaderName = Field(
        "x-model",
        description="Header that overrides the body's 'model' field for routing. Default: x-model.",
    )
    routes: list[Route] = Field(min_length=1, description="Routes, first match wins.")
    service_classes: ServiceClasses | None = Field(
        None,
        description="Classes of service: which requests keep their latency and which are shed "
        "or diverted first when the pool is saturated. Default: none (one class, never shed).",
    )
    virtual_models: list[VirtualModel] = Field(
        default_factory=list,
        description="Model names that no pool serves, each answered by a small or a large "
        "model that a route of this policy serves, chosen per request by difficulty. "
        "Default: none.",
    )

    @model_validator(mode="after")
    def _check(self) -> RoutingPolicySpec:
        names = [route.name for route in self.routes]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"route name {name!r} is used twice")
        errors = self._class_errors(names) + self._virtual_model_errors()
        if errors:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError("value_error", message.replace("{", "{{")),
                        loc=location,
                        input=None,
                    )
                    for location, message in errors
                ],
            )
        return self

    def _virtual_model_errors(self) -> list[tuple[tuple[str | int, ...], str]]:
        """Targets of virtual models must be models a route names; names must be new."""
        errors: list[tuple[tuple[str | int, ...], str]] = []
        served = sorted({model for route in self.routes for model in route.match.models})
        seen: set[str] = set()
        for index, virtual in enumerate(self.virtual_models):
            where: tuple[str | int, ...] = ("virtualModels", index)
            if virtual.name in served:
                errors.append(
                    ((*where, "name"), f"{virtual.name!r} is already a model a route serves")
                )
            if virtual.name in seen:
                errors.append(
                    ((*where, "name"), f"virtual model {virtual.name!r} is declared twice")
                )
            seen.add(virtual.name)
            small_routes = [r for r in self.routes if virtual.small in r.match.models]
            if virtual.escalation is not None and small_routes and len(small_routes[0].tiers) > 1:
                errors.append(
                    (
                        (*where, "escalation"),
                        f"escalation retries on the large model's pools, so the route of "
                        f"{virtual.small!r} ({small_routes[0].name}) needs a single tier",
                    )
                )
            fields: list[tuple[str | int, ...]] = (
                [("targets", index, "model") for index in range(len(virtual.targets))]
                if virtual.targets
                else [("small",), ("large",)]
            )
            for field, target in zip(fields, virtual.models, strict=True):
                if target not in served:
                    errors.append(
                        (
                            (*where, *field),
                            f"model {target!r} is not in any route's match.models"
                            + (f" (served: {', '.join(served)})" if served else ""),
                        )
                    )
        return errors

    def _class_errors(self, routes: list[str]) -> list[tuple[tuple[str | int, ...], str]]:
        """References between classes and routes, each with the path of the field at fault."""
        errors: list[tuple[tuple[str | int, ...], str]] = []
        classes = self.service_classes
        declared = classes.names() if classes is not None else []
        for index, route in enumerate(self.routes):
            if route.service_class is not None and route.service_class not in declared:
                errors.append(
                    (
                        ("routes", index, "serviceClass"),
                        f"class {route.service_class!r} is not declared in serviceClasses"
                        + (f" (declared: {', '.join(declared)})" if declared else ""),
                    )
                )
        if classes is None:
            return errors
        where: tuple[str | int, ...] = ("serviceClasses",)
        for index, name in enumerate(declared):
            if declared.index(name) != index:
                errors.append(
                    ((*where, "classes", index, "name"), f"class {name!r} is declared twice")
                )
        if classes.default_class is not None and classes.default_class not in declared:
            errors.append(
                (
                    (*where, "defaultClass"),
                    f"class {classes.default_class!r} is not declared; declared: "
                    + ", ".join(declared),
                )
            )
        for index, service_class in enumerate(classes.classes):
            if service_class.divert_to is not None and service_class.divert_to not in routes:
                errors.append(
                    (
                        (*where, "classes", index, "divertTo"),
                        f"route {service_class.divert_to!r} is not a route of this policy; "
                        f"routes: {', '.join(routes)}",
                    )
                )
        return errors
