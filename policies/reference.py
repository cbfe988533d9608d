"""The policy reference (docs/policy-reference.md), generated from the models.

Every object kind's JSON schema is the one pydantic gives FastAPI for the OpenAPI document at
``/docs``, so the reference and the API schema say the same thing in the same words: the
field docstrings of ``policies.models``. ``kvpilot docs policy-reference`` prints it, and a
test fails when the file in docs/ is not what this module makes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from policies.models import API_VERSION, KINDS

Schema = Mapping[str, Any]

HEADER = f"""# Policy reference

Every object kind and every field, with its type, default and meaning. This page is generated
from the models in `policies/models/` by `kvpilot docs policy-reference`: do not edit it by
hand. The same text is in the REST API's OpenAPI schema (`/docs`, `/openapi.json`), and
`tests/test_docs_policy_reference.py` fails when this page is not current. After changing a
model, run:

```sh
kvpilot docs policy-reference -o docs/policy-reference.md
```

Each object has `apiVersion: {API_VERSION}`, a `kind`, `metadata.name` and (except an empty
Fleet) a `spec`. Field names are camelCase, as in YAML and JSON; a field not listed here is
refused with its path. For what the objects do together, see [concepts](concepts.md);
complete examples are in `policies/examples/`.
"""


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _anchor(name: str) -> str:
    return name.lower()


def _type(schema: Schema) -> str:
    """A field's type, in words, with its limits; references link to their section."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{_anchor(name)})"
    if "anyOf" in schema:
        options = [option for option in schema["anyOf"] if option.get("type") != "null"]
        text = " or ".join(_type(option) for option in options)
        return text if len(options) == len(schema["anyOf"]) else f"{text} (or null)"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " | ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        text = f"list of {_type(schema.get('items', {}))}"
    elif kind == "object":
        values = schema.get("additionalProperties")
        text = f"map of string to {_type(values)}" if isinstance(values, dict) else "object"
    else:
        text = str(kind or "any")
    return text + _limits(schema)


def _limits(schema: Schema) -> str:
    limits = []
    for key, word in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
        ("minLength", "length >="),
        ("maxLength", "length <="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
    ):
        if key in schema:
            limits.append(f"{word} {schema[key]}")
    if "pattern" in schema:
        # A pattern may hold a backtick: a double-backtick code span keeps it whole.
        fence = "``" if "`" in schema["pattern"] else "`"
        pad = " " if fence == "``" else ""
        limits.append(f"matches {fence}{pad}{schema['pattern']}{pad}{fence}")
    return f" ({', '.join(limits)})" if limits else ""


def _cell(text: str) -> str:
    """Table-safe text: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _default(field: Schema, required: bool) -> str:
    if required:
        return "required"
    if "default" not in field:
        return ""
    return f"`{json.dumps(field['default'])}`"


def _table(schema: Schema) -> list[str]:
    properties: Mapping[str, Schema] = schema.get("properties", {})
    if not properties:
        return ["No fields."]
    required = set(schema.get("required", ()))
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in properties.items():
        cells = (
            f"`{name}`",
            _cell(_type(field)),
            _cell(_default(field, name in required)),
            _cell(field.get("description", "")),
        )
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _refs(schema: Any) -> Iterator[str]:
    """The names of the definitions a schema refers to, in the order they appear."""
    if isinstance(schema, Mapping):
        if "$ref" in schema:
            yield _ref_name(schema["$ref"])
        for value in schema.values():
            yield from _refs(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _refs(value)


def _section(level: str, name: str, schema: Schema) -> list[str]:
    lines = [f"{level} {name}", ""]
    if schema.get("description"):
        lines += [" ".join(schema["description"].split()), ""]
    return [*lines, *_table(schema), ""]


def kind_schemas() -> dict[str, dict[str, Any]]:
    """Each kind's JSON schema, as FastAPI puts it in the OpenAPI document."""
    return {kind: model.model_json_schema(by_alias=True) for kind, model in KINDS.items()}


def policy_reference() -> str:
    """The whole reference page, in Markdown."""
    lines = [HEADER]
    lines += ["Kinds: " + ", ".join(f"[{kind}](#{_anchor(kind)})" for kind in KINDS) + ".", ""]
    written: set[str] = set()
    for kind, schema in kind_schemas().items():
        definitions: Mapping[str, Schema] = schema.get("$defs", {})
        lines += _section("##", kind, schema)
        pending = list(_refs(schema.get("properties", {})))
        while pending:
            name = pending.pop(0)
            if name in written:
                continue
            written.add(name)
            definition = definitions[name]
            lines += _section("###", name, definition)
            pending += [
                ref for ref in _refs(definition.get("properties", {})) if ref not in written
            ]
    return "\n".join(lines).rstrip() + "\n"
