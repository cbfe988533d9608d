"""The REST dry run renders with the golden tests' renderer: a case's objects and registered
endpoints stored in a real etcd through the API, the last object sent with ``?dryRun=true``,
give exactly the resources the case's golden files hold."""

from __future__ import annotations

import pytest
from harness.api import Harness
from harness.golden import case_document, load_case

from policies import KIND_PATHS
from xdsserver.render import render_input

pytestmark = pytest.mark.e2e

# Cases without telemetry: the dry run reads objects and registered endpoints only.
CASES = ["registered-endpoints", "rollout-fleet-weights", "fleets", "external-provider"]


@pytest.mark.parametrize("case", CASES)
async def test_dry_run_of_a_case_gives_its_golden_resources(api: Harness, case: str) -> None:
    document = case_document(case)
    *stored, last = document["objects"]
    for obj in stored:
        path = f"/v1/{KIND_PATHS[obj['kind']]}/{obj['metadata']['name']}"
        response = await api.http.put(path, json={"apiVersion": "kvpilot.io/v1", **obj})
        assert response.status_code in (200, 201), response.text
    for pool, endpoints in (document.get("endpoints") or {}).items():
        for endpoint in endpoints:
            endpoint_id = f"{endpoint['address']}:{endpoint['port']}"
            response = await api.http.put(
                f"/v1/pools/{pool}/endpoints/{endpoint_id}", json=endpoint
            )
            assert response.status_code == 200, response.text
    response = await api.http.put(
        f"/v1/{KIND_PATHS[last['kind']]}/{last['metadata']['name']}",
        json={"apiVersion": "kvpilot.io/v1", **last},
        params={"dryRun": "true"},
    )
    assert response.status_code == 200, response.text
    preview = response.json()
    assert preview["dryRun"] is True
    assert preview["fleets"] == render_input(load_case(case))["fleets"]
    assert await api.raw(f"objects/{KIND_PATHS[last['kind']]}/{last['metadata']['name']}") is None
