"""Reading policy objects from YAML or JSON, with errors a user can act on."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from policies import jsondoc
from policies.models import API_VERSION, KINDS, PolicyObject, Rollout


@dataclass(frozen=True, slots=True)
class FieldError:
    """One problem at one place in a document (``spec.routes[0].tiers``)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class PolicyError(ValueError):
    """A document is not a valid policy object; ``errors`` says where and why."""

    def __init__(self, errors: Iterable[FieldError], source: str = "") -> None:
        self.errors = list(errors)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(prefix + "; ".join(str(error) for error in self.errors))


def field_path(location: Iterable[int | str]) -> str:
    """A pydantic error location as a document path: ``spec.routes[0].tiers``."""
    out = ""
    for part in location:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def field_errors(error: ValidationError) -> list[FieldError]:
    """One FieldError per problem pydantic found, with the document's own path."""
    errors = []
    for item in error.errors():
        # Tagged-union and "before" validators add type names to the location; drop them so
        # the path is the document's own.
        location = [part for part in item["loc"] if not str(part).startswith("function-")]
        message = item["msg"].removeprefix("Value error, ")
        errors.append(FieldError(field_path(location), message))
    return errors


def parse_object(data: Any, *, source: str = "") -> PolicyObject:
    """Validate one decoded document and return the typed object."""
    if not isinstance(data, Mapping):
        raise PolicyError([FieldError("", "a policy object must be a mapping")], source)
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        known = ", ".join(sorted(KINDS))
        raise PolicyError(
            [FieldError("kind", f"unknown kind {kind!r}; expected one of {known}")], source
        )
    api_version = data.get("apiVersion", API_VERSION)
    if api_version != API_VERSION:
        raise PolicyError(
            [
                FieldError(
                    "apiVersion", f"unsupported apiVersion {api_version!r}; use {API_VERSION}"
                )
            ],
            source,
        )
    try:
        obj = KINDS[kind].model_validate(data)
    except ValidationError as error:
        raise PolicyError(field_errors(error), source) from None
    if isinstance(obj, Rollout) and (problems := obj.spec.problems()):
        raise PolicyError(
            [FieldError(f"spec.{path}", message) for path, message in problems], source
        )
    return obj


def decode_documents(text: str | bytes, *, source: str = "") -> list[Any]:
    """Decode JSON or (multi-document) YAML; empty documents are skipped. Bytes must be UTF-8:
    anything else is a `PolicyError` that says so, as is nesting deeper than
    `jsondoc.MAX_DEPTH`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PolicyError(
                [
                    FieldError(
                        "",
                        f"not UTF-8 text (byte {error.start} is {text[error.start]:#04x}); "
                        "save the file as UTF-8",
                    )
                ],
                source,
            ) from None
    try:
        if text.lstrip().startswith(("{", "[")):
            decoded = jsondoc.loads(text)
            return decoded if isinstance(decoded, list) else [decoded]
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except jsondoc.JsonError as error:
        raise PolicyError([FieldError("", f"not valid JSON: {error}")], source) from None
    except yaml.YAMLError as error:
        raise PolicyError([FieldError("", f"not valid YAML or JSON: {error}")], source) from None
    except RecursionError:
        raise PolicyError(
            [FieldError("", "not valid YAML: it is nested too deeply")], source
        ) from None
    if any(jsondoc.depth_exceeds(doc, jsondoc.MAX_DEPTH) for doc in documents):
        raise PolicyError(
            [FieldError("", f"it is nested more than {jsondoc.MAX_DEPTH} levels deep")], source
        )
    return documents


def load_objects(path: Path) -> list[PolicyObject]:
    """Load every object from a file, or from every .yaml/.yml/.json file of a directory."""
    files = (
        sorted(p for p in path.iterdir() if p.suffix in {".yaml", ".yml", ".json"})
        if path.is_dir()
        else [path]
    )
    objects: list[PolicyObject] = []
    for file in files:
        for index, document in enumerate(decode_documents(file.read_bytes(), source=str(file))):
            objects.append(parse_object(document, source=f"{file} (document {index + 1})"))
    return objects
