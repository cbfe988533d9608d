"""The rollout controller: moves a route tier's weights step by step, watching the data plane.

Exactly one kvpilot replica drives rollouts at a time (``controlplane.election``). Each
rollout's progress lives in etcd at ``{prefix}/status/rollouts/{name}``: its phase, its step,
when the step started, the weights it started from, the data-plane counters at the step's start
and a history of every step, verdict and rollback with its time and numbers. Every change of
step writes the RoutingPolicy's new weights and this record in one etcd transaction, fenced by
the leader key, so a replica that takes over after the driver died finds either the old step
or the new one, never half of each: it resumes from the recorded step, holding it only for what
is left of its minimum, and no step is applied twice or skipped.

Pause, resume, abort and promote arrive as a command at ``{prefix}/status/rollout-commands/
{name}`` (the REST API writes it); the driver applies it and deletes it in the same
transaction as the change it makes.

Phases: ``Progressing`` -> ``Succeeded``; or ``RolledBack`` (a rule failed and ``onFailure``
is rollback), ``Paused`` (a person paused it, or a rule failed with ``onFailure: pause``),
``Aborted`` (back to the start weights on request), ``Failed`` (the route or pools it names
are gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from compiler.rollout import Verdict, reference_errors, target_cluster
from compiler.rolloutweights import policy_with, tier_weights
from controlplane.election import LeaderElection, heartbeat_key, leader_key
from controlplane.etcd import EtcdClient, EtcdClosed, EtcdError
from controlplane.etcd.keys import Keys, decode_json, encode_json
from controlplane.rollouts.analysis import PrometheusQueries
from controlplane.rollouts.signals import collect
from controlplane.rollouts.state import (
    LEADER_JOB,
    ROLLOUT_COMMAND_PREFIX,
    ROLLOUT_STATE_PREFIX,
    RolloutRead,
    allowed,
    command_key,
    judge,
    read_records,
    rollout_states,
    state_key,
)
from policies import PolicyError, Rollout, parse_object
from signals import PolicyState

log = logging.getLogger(__name__)

HISTORY_LIMIT = 200


def _reach(fleets: list[str] | None) -> dict[str, Any]:
    """The fields a step event gets when the step reaches only the canary fleets."""
    return {"fleets": fleets} if fleets else {}


def _in(fleets: list[str] | None) -> str:
    return f" in fleets {', '.join(fleets)}" if fleets else ""


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------


class RolloutController:
    """Drives every Rollout while this replica holds the rollouts leader key."""

    def __init__(
        self,
        client: EtcdClient,
        keys: Keys,
        items: Any,
        replica_id: str,
        *,
        lease_ttl: int = 10,
        tick: float = 0.25,
        clock: Any = time.time,
    ) -> None:
        self.client = client
        self.keys = keys
        self.items = items
        """Callable returning the etcd mirror's items (relative key -> KeyValue)."""
        self.replica_id = replica_id
        self.tick = tick
        self.clock = clock
        self.election = LeaderElection(
            client, keys.absolute(leader_key(LEADER_JOB)), replica_id, ttl=lease_ttl
        )
        self.queries = PrometheusQueries()

    @property
    def leading(self) -> bool:
        return self.election.leadership is not None

    async def run(self) -> None:
        """Campaign, and drive rollouts while leader, until cancelled or until the etcd client
        is closed."""
        async with self.client.keepalive_forever(
            self.election.ttl, on_regrant=self.election.on_regrant
        ) as keeper:
            try:
                while True:
                    try:
                        if not self.leading:
                            self.election.lease = keeper.lease_id
                            items = self.items()
                            await self.election.follow(
                                items.get(leader_key(LEADER_JOB)),
                                items.get(heartbeat_key(LEADER_JOB)),
                            )
                        if self.leading:
                            await self.election.beat()
                        if self.leading:
                            await self.drive_all()
                    except EtcdClosed:
                        log.info("etcd client closed; rollouts are no longer driven")
                        return
                    except EtcdError as error:
                        log.warning("rollouts: etcd: %s; retrying", error)
                    await asyncio.sleep(
                        min(self.tick, self.election.heartbeat_interval)
                        if self.leading
                        else self.election.poll_interval
                    )
            finally:
                await self.queries.aclose()
                await asyncio.shield(self.election.resign())

    async def drive_all(self) -> None:
        items = self.items()
        rollouts = rollout_states(items)
        for name, (rollout, _) in rollouts.items():
            created = items[self.keys.object("Rollout", name)].create_revision
            try:
                await self.drive(rollout, created)
            except EtcdError:
                raise
            except Exception:
                log.exception("rollout %s: step failed; retrying", name)
        # Records of rollouts that were deleted.
        for key in list(items):
            if (
                key.startswith((ROLLOUT_STATE_PREFIX, ROLLOUT_COMMAND_PREFIX))
                and key.rsplit("/", 1)[1] not in rollouts
            ):
                await self.client.transact(
                    [self.election.leadership.fence] if self.election.leadership else [],
                    deletes=[self.keys.absolute(key)],
                )

    async def drive(self, rollout: Rollout, created: int) -> None:
        """One decision for one rollout."""
        read = await read_records(self.client, self.keys, rollout, created)
        state = read.state
        # One time per decision, rounded once: it is both the recorded event time and the
        # start a step's hold is measured from. Rounding the record alone let two step events
        # read less than the step's minimum apart (0.3 s held became 0.29999995 in history).
        now = round(self.clock(), 3)
        if state is None:
            await self._start(rollout, created, read, now)
            return
        phase = state.get("phase")
        if read.command is not None:
            await self._command(rollout, read, now)
            return
        if phase != "Progressing":
            return
        if read.policy is None:
            await self._finish(
                rollout,
                read,
                "Failed",
                None,
                now,
                f"RoutingPolicy {rollout.spec.target.policy!r} is gone or invalid",
            )
            return
        step = min(int(state["step"]), len(rollout.spec.steps) - 1)
        spec = rollout.spec.steps[step]
        queried = await self.queries.values(rollout, state, now)
        verdict = judge(self.items(), rollout, state, queried)
        if verdict.outcome == "fail":
            await self._fail(rollout, read, verdict, now)
            return
        held = now - float(state["stepStartedAt"])
        if held < spec.min_duration or verdict.canary.requests < spec.min_requests:
            return
        if verdict.outcome == "waiting":
            return
        if state.get("fleets"):
            await self._widen(rollout, read, verdict, now)
        elif step + 1 < len(rollout.spec.steps):
            await self._step(rollout, read, step + 1, verdict, now)
        else:
            await self._finish(rollout, read, "Succeeded", verdict, now, "every step passed")

    # -- transitions ---------------------------------------------------------------------------

    async def _commit(
        self,
        rollout: Rollout,
        read: RolloutRead,
        state: dict[str, Any],
        *,
        weights: Mapping[str, int] | None = None,
        canary_weights: Mapping[str, int] | None = None,
        consume_command: bool = False,
    ) -> bool:
        leadership = self.election.leadership
        if leadership is None:
            return False
        name = rollout.metadata.name
        compares = [leadership.fence, (self.keys.absolute(state_key(name)), read.state_revision)]
        puts = [(self.keys.absolute(state_key(name)), encode_json(state))]
        if weights is not None and read.policy is not None:
            policy_key = self.keys.absolute(
                self.keys.object("RoutingPolicy", rollout.spec.target.policy)
            )
            compares.append((policy_key, read.policy_revision))
            body = policy_with(rollout, read.policy, weights, canary_weights)
            puts.append((policy_key, encode_json(body)))
        deletes = []
        if consume_command:
            compares.append((self.keys.absolute(command_key(name)), read.command_revision))
            deletes.append(self.keys.absolute(command_key(name)))
        revision = await self.client.transact(compares, puts=puts, deletes=deletes)
        if revision is None:
            # Someone wrote in between (the policy, a command, another leader): read again.
            await self.election.still_leader()
            return False
        return True

    def _event(self, state: dict[str, Any], now: float, event: str, **fields: Any) -> None:
        history = state.setdefault("history", [])
        history.append({"at": now, "event": event, "by": self.replica_id, **fields})
        del history[:-HISTORY_LIMIT]

    async def _start(self, rollout: Rollout, created: int, read: RolloutRead, now: float) -> None:
        state: dict[str, Any] = {"object": created, "driver": self.replica_id, "history": []}
        objects = []
        for kv_key, kv in self.items().items():
            if kv_key.startswith(
                tuple(self.keys.objects(kind) for kind in ("Pool", "RoutingPolicy", "Fleet"))
            ):
                try:
                    objects.append(parse_object(decode_json(kv)))
                except PolicyError:
                    continue
        if read.policy is not None:
            objects.append(read.policy)  # as read now, after the mirror's copy
        errors = reference_errors(rollout, PolicyState.from_objects(objects))
        if errors:
            state.update(phase="Failed", step=0, message="; ".join(map(str, errors)))
            self._event(state, now, "failed", message=state["message"])
            await self._commit(rollout, read, state)
            return
        assert read.policy is not None
        start = tier_weights(rollout, read.policy)
        weights = rollout.spec.step_weights(0)
        fleets = list(rollout.spec.fleets) or None
        state.update(
            phase="Progressing",
            step=0,
            startWeights=start,
            stepStartedAt=now,
            fleets=fleets,
            baseline=self._baseline(rollout, fleets),
            failedRequests=0,
            message="",
        )
        self._event(state, now, "start", weights=start)
        self._event(state, now, "step", step=0, weights=weights, **_reach(fleets))
        committed = await self._commit(
            rollout,
            read,
            state,
            weights=start if fleets else weights,
            canary_weights=weights if fleets else None,
        )
        if committed:
            log.info(
                "rollout %s: started, step 0 %s%s", rollout.metadata.name, weights, _in(fleets)
            )

    def _baseline(self, rollout: Rollout, fleets: list[str] | None) -> dict[str, Any]:
        counters = collect(self.items(), target_cluster(rollout), fleets)
        return {
            replica: {pool: signals.as_json() for pool, signals in pools.items()}
            for replica, pools in counters.items()
        }

    def _close_step(self, state: dict[str, Any], verdict: Verdict) -> None:
        state["failedRequests"] = int(state.get("failedRequests", 0)) + verdict.canary.errors
        state["verdict"] = verdict.as_json()

    async def _step(
        self, rollout: Rollout, read: RolloutRead, step: int, verdict: Verdict, now: float
    ) -> None:
        assert read.state is not None
        state = dict(read.state)
        self._close_step(state, verdict)
        weights = rollout.spec.step_weights(step)
        fleets = list(rollout.spec.fleets) or None
        self._event(state, now, "verdict", step=step - 1, **verdict.as_json())
        self._event(state, now, "step", step=step, weights=weights, **_reach(fleets))
        state.update(
            step=step,
            stepStartedAt=now,
            fleets=fleets,
            baseline=self._baseline(rollout, fleets),
            driver=self.replica_id,
        )
        committed = await self._commit(
            rollout,
            read,
            state,
            # With canary fleets, the others keep the step before until this one passes.
            weights=rollout.spec.step_weights(step - 1) if fleets else weights,
            canary_weights=weights if fleets else None,
        )
        if committed:
            log.info("rollout %s: step %d %s%s", rollout.metadata.name, step, weights, _in(fleets))

    async def _widen(
        self, rollout: Rollout, read: RolloutRead, verdict: Verdict, now: float
    ) -> None:
        """The step passed in its canary fleets: it reaches every fleet, and is held and
        judged again on all of their traffic."""
        assert read.state is not None
        state = dict(read.state)
        step = int(state["step"])
        self._close_step(state, verdict)
        weights = rollout.spec.step_weights(step)
        self._event(state, now, "verdict", step=step, fleets=state["fleets"], **verdict.as_json())
        self._event(state, now, "widen", step=step, weights=weights)
        state.update(
            stepStartedAt=now,
            fleets=None,
            baseline=self._baseline(rollout, None),
            driver=self.replica_id,
        )
        if await self._commit(rollout, read, state, weights=weights):
            log.info("rollout %s: step %d in every fleet", rollout.metadata.name, step)

    async def _fail(
        self, rollout: Rollout, read: RolloutRead, verdict: Verdict, now: float
    ) -> None:
        assert read.state is not None
        failed = [r for r in verdict.results if r.outcome == "fail"]
        message = "; ".join(
            f"{r.rule}: canary {r.canary:.4g} above {r.limit:.4g}"
            for r in failed
            if r.canary is not None and r.limit is not None
        )
        if rollout.spec.on_failure == "pause":
            state = dict(read.state)
            state.update(
                phase="Paused", message=f"analysis failed: {message}", verdict=verdict.as_json()
            )
            self._event(state, now, "verdict", step=state["step"], **verdict.as_json())
            self._event(state, now, "paused", reason="analysis")
            await self._commit(rollout, read, state)
            return
        await self._finish(rollout, read, "RolledBack", verdict, now, f"analysis failed: {message}")

    async def _finish(
        self,
        rollout: Rollout,
        read: RolloutRead,
        phase: str,
        verdict: Verdict | None,
        now: float,
        message: str,
        *,
        consume_command: bool = False,
    ) -> None:
        assert read.state is not None
        state = dict(read.state)
        weights: Mapping[str, int] | None = None
        if phase in ("RolledBack", "Aborted"):
            weights = state.get("startWeights") or {}
        elif phase == "Succeeded" and consume_command:  # promote: straight to the end
            weights = rollout.spec.step_weights(len(rollout.spec.steps) - 1)
            state["step"] = len(rollout.spec.steps) - 1
        if verdict is not None:
            self._close_step(state, verdict)
            self._event(state, now, "verdict", step=state["step"], **verdict.as_json())
        event = {
            "RolledBack": "rollback",
            "Aborted": "abort",
            "Succeeded": "succeeded",
            "Failed": "failed",
        }[phase]
        self._event(state, now, event, weights=weights, message=message)
        state.update(
            phase=phase, message=message, finishedAt=now, driver=self.replica_id, fleets=None
        )
        if await self._commit(
            rollout, read, state, weights=weights, consume_command=consume_command
        ):
            log.info("rollout %s: %s (%s)", rollout.metadata.name, phase, message)

    async def _command(self, rollout: Rollout, read: RolloutRead, now: float) -> None:
        assert read.state is not None and read.command is not None
        command = read.command
        state = dict(read.state)
        problem = allowed(command, state.get("phase"))
        if problem is not None:
            self._event(state, now, "ignored", command=command, message=problem)
            await self._commit(rollout, read, state, consume_command=True)
            return
        if command in ("abort", "promote"):
            verdict = (
                judge(self.items(), rollout, state) if state.get("phase") == "Progressing" else None
            )
            await self._finish(
                rollout,
                read,
                "Aborted" if command == "abort" else "Succeeded",
                verdict,
                now,
                f"{command} requested",
                consume_command=True,
            )
            return
        if command == "pause":
            state.update(phase="Paused", message="paused on request")
            self._event(state, now, "paused", reason="request")
        else:  # resume: the step starts over, with fresh numbers
            state.update(
                phase="Progressing",
                message="",
                stepStartedAt=now,
                baseline=self._baseline(rollout, state.get("fleets")),
            )
            self._event(state, now, "resumed", step=state["step"])
        await self._commit(rollout, read, state, consume_command=True)
