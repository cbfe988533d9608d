"""docs/policy-reference.md is what `kvpilot docs policy-reference` makes from the models, and
the models' descriptions are the ones the REST API's OpenAPI schema serves."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from harness.api import Harness

from commands.cli import main
from controlplane.local import repo_root
from policies.reference import kind_schemas, policy_reference

PAGE = repo_root() / "docs" / "policy-reference.md"


def test_the_page_is_current() -> None:
    assert PAGE.read_text() == policy_reference(), (
        "docs/policy-reference.md is out of date: run "
        "`kvpilot docs policy-reference -o docs/policy-reference.md`"
    )


def test_the_command_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs", "policy-reference"]) == 0
    assert capsys.readouterr().out == policy_reference()


def test_every_field_of_every_kind_is_on_the_page() -> None:
    text = policy_reference()
    for kind, schema in kind_schemas().items():
        assert f"\n## {kind}\n" in text
        for name, definition in schema.get("$defs", {}).items():
            assert f"\n### {name}\n" in text, name
            for field in definition.get("properties", {}):
                assert f"| `{field}` |" in text, f"{name}.{field}"


def _descriptions(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(schema, Mapping):
        if isinstance(schema.get("description"), str):
            yield path, schema["description"]
        for key, value in schema.items():
            yield from _descriptions(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from _descriptions(value, f"{path}/{index}")


async def test_the_openapi_schema_has_the_same_text(api: Harness) -> None:
    components = (await api.http.get("/openapi.json")).json()["components"]["schemas"]
    for kind, schema in kind_schemas().items():
        for name, definition in [(kind, schema), *schema.get("$defs", {}).items()]:
            served = components.get(name) or components.get(f"{name}-Input")
            assert served is not None, f"{name} is not in /openapi.json"
            ours = dict(_descriptions({k: v for k, v in definition.items() if k != "$defs"}))
            assert ours == dict(_descriptions(served)), name
