"""REST routes of rollouts: progress with the live verdict and history, and the commands a
person gives a running rollout (the driving replica applies them)."""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

from fastapi import FastAPI, Path
from fastapi.responses import JSONResponse

from api.context import Admin, ApiContext, ApiError, Reader, parse_for_kind
from compiler.rollout import COMMANDS
from controlplane.election import leader_key
from controlplane.etcd.keys import decode_json
from controlplane.etcd.store import Actor
from controlplane.rollouts.state import (
    LEADER_JOB,
    allowed,
    command_key,
    rollout_states,
    state_key,
    summary,
)
from policies import PolicyError, Rollout

log = logging.getLogger(__name__)

ObjectName = Annotated[str, Path(description="Rollout name.")]


def rollout_driver(context: ApiContext) -> dict[str, Any] | None:
    """The replica that holds the rollouts leader key now, and since when (Unix time)."""
    if context.mirror is None:
        return None
    kv = context.mirror.items.get(leader_key(LEADER_JOB))
    body = decode_json(kv) if kv is not None else None
    replica = body.get("replica") if body else None
    if not isinstance(replica, str):
        return None
    since = body.get("since") if body else None
    return {"replica": replica, "since": since if isinstance(since, int | float) else None}


def rollout_summaries(context: ApiContext) -> list[dict[str, Any]]:
    if context.mirror is None:
        return []
    items = context.mirror.items
    return [summary(items, rollout, state) for rollout, state in rollout_states(items).values()]


def add_rollout_routes(app: FastAPI, context: ApiContext) -> None:
    store = context.store
    tags: list[str | Any] = ["rollouts"]

    async def rollout_and_state(name: str) -> tuple[Rollout, dict[str, Any] | None, int]:
        stored = await store.get("Rollout", name)
        if stored is None:
            raise ApiError(404, f"Rollout {name!r} does not exist")
        try:
            rollout = parse_for_kind(stored.body, "Rollout")
        except PolicyError as error:
            raise ApiError(409, f"Rollout {name!r} in etcd is invalid ({error}); fix it") from None
        assert isinstance(rollout, Rollout)
        state = await store.get_record(state_key(name))
        if state is not None and state.get("object") != stored.created_revision:
            state = None
        return rollout, state, stored.created_revision

    @app.get(
        "/v1/rollouts/{name}/status",
        tags=tags,
        operation_id="rollout_status",
        summary="A rollout's phase, step, weights, live verdict and its recorded history",
    )
    async def rollout_status(name: ObjectName, _: Reader) -> dict[str, Any]:
        rollout, state, _created = await rollout_and_state(name)
        items = context.mirror.items if context.mirror is not None else {}
        return {**summary(items, rollout, state), "history": (state or {}).get("history", [])}

    @app.post(
        "/v1/rollouts/{name}/{command}",
        tags=tags,
        operation_id="rollout_command",
        summary="pause, resume, abort (back to the start weights) or promote (to the last "
        "step at once); the driving replica applies it within a tick",
        status_code=202,
        responses={404: {"description": "No such rollout."}, 409: {"description": "Not now."}},
    )
    async def rollout_command(
        name: ObjectName,
        command: Annotated[str, Path(description="pause, resume, abort or promote.")],
        principal: Admin,
    ) -> JSONResponse:
        if command not in COMMANDS:
            raise ApiError(404, f"unknown rollout command {command!r}; use {', '.join(COMMANDS)}")
        _rollout, state, _created = await rollout_and_state(name)
        phase = (state or {}).get("phase")
        problem = allowed(command, phase)
        if problem is not None or state is None:
            raise ApiError(409, problem or f"Rollout {name!r} has not started yet; retry shortly")
        await store.put_record(
            command_key(name),
            {"command": command, "at": time.time(), "by": principal.name},
            kind="RolloutCommand",
            name=name,
            actor=Actor(principal.name, "rollout_command"),
        )
        log.info("rollout %s: %s requested by %s", name, command, principal.name)
        return JSONResponse({"rollout": name, "command": command, "phase": phase}, status_code=202)
