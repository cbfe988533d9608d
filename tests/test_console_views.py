"""Every view of the console in a real Chromium, calm and in trouble, with the browser's error
log read throughout: no view logs an error (a missing favicon, a failed poll, an uncaught
exception), and at 1280 px the header holds every pill it can show (a NACKing Envoy, a
restricted class, a saturated route, an invalid object) with none cut off."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness.auth import READ_TOKEN
from harness.builders import fleet, policy, pool, service_classes
from harness.console import Console, open_console, shoot

from controlplane.local import free_port

pytestmark = pytest.mark.e2e

WIDTH = 1280
VIEWS = {
    "endpoints": "#endpoints [data-endpoint]",
    "routes": '.route[data-route="chat"]',
    "fleets": 'tr[data-node="envoy-edge-1"]',
    "changes": "article.change",
    "rollouts": "#rollouts .empty",
    "classes": "#classes",
}
"""Each tab, and what shows once its view has drawn."""

HEADER_FIT = """() => {
  const bar = document.querySelector('.topbar').getBoundingClientRect();
  const health = document.querySelector('#health');
  const box = health.getBoundingClientRect();
  const inside = (r) => r.left >= box.left - 0.5 && r.right <= box.right + 0.5
      && r.top >= bar.top - 0.5 && r.bottom <= bar.bottom + 0.5;
  const who = document.querySelector('#who').getBoundingClientRect();
  return {
    pills: [...health.querySelectorAll('.pill')].map((p) => p.innerText),
    clipped: [...health.querySelectorAll('.pill')]
        .filter((p) => !inside(p.getBoundingClientRect())).map((p) => p.innerText),
    overflows: health.scrollWidth > health.clientWidth + 0.5,
    whoVisible: who.right <= document.documentElement.clientWidth + 0.5 && who.width > 0,
    pageScrolls: document.documentElement.scrollWidth > document.documentElement.clientWidth,
  };
}"""


def visit_every_view(page: Any) -> None:
    for tab, shown in VIEWS.items():
        page.click(f'a[data-tab="{tab}"]')
        page.wait_for_selector(shown, state="attached", timeout=15_000)
        page.wait_for_selector(f'section[data-view="{tab}"]:not([hidden])', timeout=15_000)


def header(page: Any) -> dict[str, Any]:
    fit: dict[str, Any] = page.evaluate(HEADER_FIT)
    assert fit["clipped"] == [] and not fit["overflows"], fit
    assert fit["whoVisible"] and not fit["pageScrolls"], fit
    return fit


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port this test holds: Envoy cannot bind a listener on it, and NACKs."""
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        yield blocker.getsockname()[1]


def test_every_view_logs_no_browser_error_and_the_header_fits_every_pill_at_1280px(
    browser: Any, console: Console, busy_port: int
) -> None:
    errors: list[str] = []
    page = open_console(browser, console.kvpilot.api_url, READ_TOKEN, width=WIDTH, errors=errors)
    api = console.api()
    try:
        with console.api() as admin:  # a change, so the changes view has an entry
            port = console.ports[0]
            path = f"/v1/pools/chat/endpoints/127.0.0.1:{port}/weight"
            assert admin.put(path, json={"weight": 120}).status_code == 200
        visit_every_view(page)
        calm = header(page)
        assert len(calm["pills"]) == 4, calm  # ready, etcd, Envoys, build

        # Trouble of every kind the header shows. A listener the edge Envoy cannot bind:
        ports = console.ports
        edge_only = policy("edge-only", busy_port, [{"name": "chat", "tiers": [["chat"]]}])
        edge_only["spec"]["fleets"] = ["edge"]
        # A service class shed (queue 20 against a bound of 4), on its own pool:
        saturation = {"queue": 4, "step": 100, "shedInterval": "200ms"}
        svc = policy("svc", free_port(), [{"name": "chat", "tiers": [["svc"]]}])
        svc["spec"]["serviceClasses"] = service_classes(saturation=saturation, whenSaturated="shed")
        # A telemetry route with session affinity whose batches are full:
        sticky = policy(
            "sticky",
            free_port(),
            [
                {
                    "name": "chat",
                    "balancing": "telemetry",
                    "sessionAffinity": {},
                    "tiers": [["sticky"]],
                }
            ],
        )
        for obj in (
            fleet("edge"),
            edge_only,
            pool("svc", ports, models=["sim-model"], telemetry={"maxAge": "60s"}),
            svc,
            pool("sticky", ports, models=["sim-model"], telemetry={"maxAge": "60s"}),
            sticky,
        ):
            kind = {"Fleet": "fleets", "Pool": "pools"}.get(obj["kind"], "routingpolicies")
            response = api.put(f"/v1/{kind}/{obj['metadata']['name']}", json=obj)
            assert response.status_code in (200, 201), response.text
        record = {"at": time.time(), "waiting": 20.0, "running": 8.0, "max_running": 8.0}
        console.put_telemetry("svc", {port: record for port in ports})
        console.put_telemetry("sticky", {port: record for port in ports})
        # And a value in etcd that is not an object (written past the API):
        console.write_raw("objects/pools/broken", b"{not json")

        for pill in ("NACKing", "batch shed on svc/chat", "sticky/chat saturated", "1 invalid"):
            page.locator("#health .pill", has_text=pill).wait_for(timeout=20_000)
        visit_every_view(page)
        trouble = header(page)
        assert len(trouble["pills"]) == 7, (
            trouble
        )  # and a restricted class, a saturated route, 1 invalid
        shoot(page, "header-1280-every-pill")

        # During the NACK the edge Envoy's RDS is behind what is served, and says why.
        page.click('a[data-tab="fleets"]')
        why = page.locator('tr[data-node="envoy-edge-1"] td[data-type="RDS"] [data-why]')
        why.wait_for(timeout=15_000)
        assert why.inner_text() == "waits on LDS (rejected)"
        # The service classes view names every saturation bound, TTFT among them.
        page.click('a[data-tab="classes"]')
        bounds = page.locator('#classes .policy[data-policy="svc"] > header').inner_text()
        # (TTFT: half the most important class's 1 s objective, the bound in force.)
        assert "saturated at queue 4.0 · KV cache 95% · TTFT 500ms " in bounds, bounds

        assert errors == []
    finally:
        page.close()
        console.write_raw("objects/pools/broken", None)
        for path in (
            "routingpolicies/edge-only",
            "routingpolicies/svc",
            "routingpolicies/sticky",
            "pools/svc",
            "pools/sticky",
            "fleets/edge",
        ):
            api.delete(f"/v1/{path}")
        api.close()
