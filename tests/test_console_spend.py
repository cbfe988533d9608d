"""The console's Spend view in a real headless Chromium, against a live kvpilot whose Envoys
count the tokens of real responses: spend per tenant, model and pool, and the window picker."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from harness.auth import READ_TOKEN
from harness.builders import chat
from harness.console import Console, open_console, shoot
from harness.wait import wait_until

pytestmark = pytest.mark.e2e


def test_the_spend_view_shows_tokens_per_tenant_model_and_pool(
    browser: Any, console: Console
) -> None:
    with httpx.Client(timeout=10) as client:
        for tenant, count in (("acme", 3), ("globex", 2)):
            for _ in range(count):
                response = client.post(console.url(), json=chat(), headers={"x-tenant-id": tenant})
                assert response.status_code == 200, response.text
    with console.api(READ_TOKEN) as api:
        wait_until(
            lambda: (
                {
                    row["tenant"]: row["requests"]
                    for row in api.get("/v1/spend", params={"by": "tenant"}).json()["rows"]
                }.get("globex")
                == 2
            ),
            30,
            message="kvpilot to count globex's requests",
        )
        completion = {
            row["tenant"]: row["completionTokens"]
            for row in api.get("/v1/spend", params={"by": "tenant"}).json()["rows"]
        }
    page = open_console(browser, console.kvpilot.api_url, READ_TOKEN, "spend")
    try:
        page.select_option("#spend-window", "total")
        acme = page.locator('table[data-by="tenant"] tr[data-tenant="acme"]')
        acme.wait_for(timeout=10_000)
        assert acme.locator("td").nth(1).inner_text() == "3"
        assert (
            page.locator('table[data-by="tenant"] tr[data-tenant="globex"] td').nth(1).inner_text()
            == "2"
        )
        assert acme.locator("td").nth(4).inner_text() == str(completion["acme"])
        page.wait_for_selector('table[data-by="model"] tr[data-model="sim-model"]', timeout=10_000)
        page.wait_for_selector('table[data-by="pool"] tr[data-pool="chat"]', timeout=10_000)
        assert "No pool has a price" in page.inner_text("#spend")
        shoot(page, "spend")
        page.select_option("#spend-window", "minute")
        page.wait_for_function(
            "document.querySelector('#spend p.muted').textContent.includes('(UTC)')",
            timeout=10_000,
        )
    finally:
        page.close()
