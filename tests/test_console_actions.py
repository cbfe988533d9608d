"""What an operator does on the console, in a real headless Chromium against a live kvpilot
with real Envoys (the rig and the browser are ``harness.console``'s): an admin drains an
endpoint and Envoy stops sending it traffic, a read token cannot, an admin pauses a rollout,
and the changes view names who made each change.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness.auth import ADMIN_TOKEN, READ_TOKEN
from harness.builders import FAST_HEALTH_CHECK, pool
from harness.console import ONCALL, ONCALL_TOKEN, Console, open_console, row, shoot
from harness.envoy import envoy_hosts
from harness.traffic import served_by
from harness.wait import wait_until

pytestmark = pytest.mark.e2e


def test_admin_drains_an_endpoint_from_the_page_and_envoy_stops_sending_it_traffic(
    browser: Any, console: Console
) -> None:
    port = console.ports[0]
    drained_id = next(r.id for r in console.backends.replicas if r.port == port)
    page = open_console(browser, console.kvpilot.api_url, ADMIN_TOKEN)
    try:
        assert page.inner_text("#who b") == "admin"
        row(page, port).locator('[data-act="drain"]').click()
        row(page, port).locator(".badge.draining").wait_for(timeout=10_000)
        wait_until(
            lambda: (
                envoy_hosts(console.envoys[0], "inference/chat")[port].get("health_flags")
                not in (None, "healthy")
            ),
            10,
            message="Envoy to see the endpoint draining",
        )
        counts = served_by(console.url(), 30)
        assert drained_id not in counts, counts
        assert sum(counts.values()) == 30 and all(k.startswith("ui") for k in counts), counts
        shoot(page, "endpoints-drained")
        row(page, port).locator('[data-act="undrain"]').click()
        row(page, port).locator(".badge.healthy").wait_for(timeout=10_000)
        # The weight editor acts too.
        row(page, port).locator('[data-act="weight"]').click()
        page.fill("#weight-input", "250")
        page.click("#weight-set")
        with console.api() as api:
            wait_until(
                lambda: any(
                    e["port"] == port and e["weight"] == 250
                    for e in api.get("/v1/pools/chat").json()["spec"]["endpoints"]
                ),
                10,
                message="the weight set on the page to reach the Pool",
            )
    finally:
        page.close()


def test_a_read_token_cannot_drain(browser: Any, console: Console) -> None:
    port = console.ports[2]
    page = open_console(browser, console.kvpilot.api_url, READ_TOKEN)
    try:
        drain = row(page, port).locator('[data-act="drain"]')
        drain.wait_for(timeout=10_000)
        assert drain.get_attribute("aria-disabled") == "true"
        drain.dispatch_event("click")  # does nothing: no request is sent
        # The badge may read "degraded" for a moment (telemetry weights), never "draining".
        row(page, port).locator(".badge").wait_for(timeout=10_000)
        assert row(page, port).locator(".badge.draining").count() == 0
        # Past the disabled button, straight to the API with the page's token: refused.
        status = page.evaluate(
            """async (path) => (await fetch(path, {method: 'PUT',
                 headers: {'Authorization': 'Bearer ' + sessionStorage.getItem('kvpilot.token'),
                           'Content-Type': 'application/json'},
                 body: JSON.stringify({health: 'draining'})})).status""",
            f"/v1/pools/chat/endpoints/127.0.0.1:{port}/health",
        )
        assert status == 403
        with console.api() as api:
            body = api.get("/v1/pools/chat").json()
        assert all(e["health"] == "healthy" for e in body["spec"]["endpoints"])
        assert "healthy" in envoy_hosts(console.envoys[0], "inference/chat")[port]["health_flags"]
    finally:
        page.close()


def test_a_rollout_shows_its_steps_and_verdict_and_an_admin_pauses_it_from_the_page(
    browser: Any, console: Console
) -> None:
    # A canary pool (one of the replicas again) and a rollout that holds its first step for
    # ten minutes: the real `kvpilot serve` drives it to Progressing at 10% canary.
    port = console.ports[2]
    canary = pool("chat-canary", [port], models=["sim-model"], health_check=FAST_HEALTH_CHECK)
    body = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Rollout",
        "metadata": {"name": "chat-canary"},
        "spec": {
            "target": {"policy": "inference", "route": "chat", "tier": 0},
            "stable": "chat",
            "canary": "chat-canary",
            "steps": [{"weight": 10, "minDuration": 600}, {"weight": 100, "minDuration": 600}],
            "analysis": {"minSample": 5, "rules": [{"metric": "errorRate", "max": 0.05}]},
        },
    }
    with console.api() as api:
        assert api.put("/v1/pools/chat-canary", json=canary).status_code in (200, 201)
        response = api.post("/v1/rollouts", json=body)
        assert response.status_code == 201, response.text
    admin = open_console(browser, console.kvpilot.api_url, ADMIN_TOKEN, "rollouts")
    reader = None
    try:
        card = admin.locator('.rollout[data-rollout="chat-canary"]')
        admin.wait_for_selector(
            '.rollout[data-rollout="chat-canary"][data-phase="Progressing"]', timeout=20_000
        )
        assert card.locator(".step").count() == 2
        current = card.locator(".step.current")
        assert current.get_attribute("data-step") == "0"
        assert "chat 90%" in current.inner_text() and "chat-canary 10%" in current.inner_text()
        assert current.locator(".held i").count() == 1  # time held against the 10 min minimum
        numbers, rules = card.locator(".verdict").nth(0), card.locator(".verdict").nth(1)
        assert "canary" in numbers.inner_text() and "stable" in numbers.inner_text()
        assert "errorRate" in rules.inner_text()
        card.locator(".events li").first.wait_for(timeout=10_000)  # the recorded history
        # The change history names the rollout as the author of the weights it wrote.
        with console.api() as api:
            items = api.get("/v1/history?limit=20").json()["items"]
        step = next(i for i in items if (i["kind"], i["name"]) == ("RoutingPolicy", "inference"))
        assert "+        weight: 10" in step["diff"], step
        assert step["author"]["actor"] == "rollout/chat-canary", step
        assert step["author"]["operation"] == "rollout step 1" and step["author"]["replica"]

        pause = card.locator('[data-command="pause"]')
        assert pause.get_attribute("aria-disabled") is None
        # The button is pressed until a poll has redrawn the current step (its time held
        # changes every poll), then released: the click still reaches it. When a poll
        # replaced the buttons too, this click went to no button (as did a person's click,
        # pressed for about a tenth of a second, about once in ten at one poll a second).
        pause.hover()
        admin.mouse.down()
        drawn = card.locator(".step.current").inner_html()
        admin.wait_for_function(
            """drawn => document.querySelector(
                 '.rollout[data-rollout="chat-canary"] .step.current')?.innerHTML !== drawn""",
            arg=drawn,
            timeout=10_000,
        )
        admin.mouse.up()
        admin.wait_for_selector(
            '.rollout[data-rollout="chat-canary"][data-phase="Paused"]', timeout=15_000
        )
        assert card.locator("[data-phase-pill]").inner_text() == "Paused"
        assert card.locator('[data-command="resume"]').get_attribute("aria-disabled") is None
        shoot(admin, "rollouts")

        reader = open_console(browser, console.kvpilot.api_url, READ_TOKEN, "rollouts")
        reader.wait_for_selector('.rollout[data-rollout="chat-canary"][data-phase="Paused"]')
        buttons = reader.locator('.rollout[data-rollout="chat-canary"] [data-command]')
        assert buttons.count() == 4
        for index in range(4):
            assert buttons.nth(index).get_attribute("aria-disabled") == "true"
        reader.locator('[data-command="resume"]').dispatch_event("click")  # sends nothing
        with console.api() as api:
            status = api.get("/v1/rollouts/chat-canary/status").json()
            assert status["phase"] == "Paused", status
    finally:
        admin.close()
        if reader is not None:
            reader.close()
        with console.api() as api:
            api.post("/v1/rollouts/chat-canary/abort")
            wait_until(
                lambda: api.get("/v1/rollouts/chat-canary/status").json()["phase"] == "Aborted",
                15,
                message="the rollout to abort back to its start weights",
            )
            api.delete("/v1/rollouts/chat-canary")


def test_the_changes_view_shows_who_made_each_change(browser: Any, console: Console) -> None:
    port = console.ports[1]
    page = open_console(browser, console.kvpilot.api_url, READ_TOKEN, "changes")
    try:
        with console.api(ONCALL_TOKEN) as api:
            response = api.put(
                f"/v1/pools/chat/endpoints/127.0.0.1:{port}/weight", json={"weight": 222}
            )
            assert response.status_code == 200, response.text
            revision = int(api.get("/v1/pools/chat").headers["etag"].strip('"'))
        change = page.locator(f'article.change[data-revision="{revision}"]')
        change.wait_for(timeout=15_000)  # the view reads the history every 5 s
        author = change.locator(f'.author[data-actor="{ONCALL}"]')
        author.wait_for(timeout=10_000)
        assert "set_endpoint_weight" in author.inner_text()
        assert "+    weight: 222" in change.locator("pre").inner_text()
        shoot(page, "changes-authors")
    finally:
        page.close()
