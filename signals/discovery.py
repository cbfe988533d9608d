"""What a model server serves: its models and the LoRA adapters it has loaded, read from its
own answers. Nothing here does I/O; the agent (``controlplane.agent``) fetches the documents.

Sources, by server:

- vLLM and SGLang list what they serve at ``GET /v1/models`` (OpenAI's format). vLLM lists
  each loaded LoRA adapter there too, with ``parent`` naming its base model; a base model's
  entry has no ``parent`` (or its own id).
- vLLM also exports ``vllm:lora_requests_info``, a gauge whose labels name the adapters of
  the requests running and waiting now (``running_lora_adapters="a,b"``), one series per
  change, valued with the time of the change. It shows an adapter the moment a request for
  it is admitted, before the next model list is read.
- Hugging Face TGI serves one model and names it in ``GET /info`` (``model_id``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

MODELS_PATHS: Mapping[str, str] = {"vllm": "/v1/models", "sglang": "/v1/models", "tgi": "/info"}
"""Where each server format lists what it serves; ``custom`` has no default."""

LORA_INFO = "vllm:lora_requests_info"
"""vLLM's gauge of the adapters in use (its labels name them)."""

MAX_MODELS = 4096
"""Most model and adapter names kept from one answer: a record lives in etcd, and a server
listing more than this is broken or hostile."""

MAX_NAME = 256
"""Longest model or adapter name kept; longer ones are dropped."""


@dataclass(frozen=True, slots=True)
class Discovered:
    """What one server said it serves: base models and loaded adapters, each sorted."""

    models: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()


class DiscoveryError(ValueError):
    """A model list that cannot be read; the message says what was wrong with it."""


def _names(values: list[str]) -> tuple[str, ...]:
    kept = {v for v in values if 0 < len(v) <= MAX_NAME}
    if len(kept) > MAX_MODELS:
        raise DiscoveryError(f"the server lists {len(kept)} models; at most {MAX_MODELS} kept")
    return tuple(sorted(kept))


def parse_models(format: str, payload: Any) -> Discovered:
    """The models and adapters in a server's model list (``MODELS_PATHS[format]``), already
    decoded from JSON. ``DiscoveryError`` when the document is not what that server sends."""
    if format == "tgi":
        model = payload.get("model_id") if isinstance(payload, dict) else None
        if not isinstance(model, str) or not model:
            raise DiscoveryError("TGI's /info has no 'model_id' string")
        return Discovered(models=_names([model]))
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise DiscoveryError("the model list has no 'data' list (OpenAI's /v1/models format)")
    models: list[str] = []
    adapters: list[str] = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise DiscoveryError("an entry of the model list has no 'id' string")
        parent = entry.get("parent")
        if isinstance(parent, str) and parent and parent != entry["id"]:
            adapters.append(entry["id"])
        else:
            models.append(entry["id"])
    return Discovered(models=_names(models), adapters=_names(adapters))


def lora_adapters(text: str) -> tuple[str, ...] | None:
    """The adapters that vLLM's ``vllm:lora_requests_info`` names in a Prometheus scrape
    (running and waiting, from its newest series), or None when the scrape has no such
    gauge. Malformed text gives None: the scrape's own parse reports it."""
    newest: tuple[float, Mapping[str, str]] | None = None
    try:
        for family in text_string_to_metric_families(text):
            if family.name != LORA_INFO:
                continue
            for sample in family.samples:
                if newest is None or sample.value >= newest[0]:
                    newest = (sample.value, sample.labels)
    except ValueError:
        return None
    if newest is None:
        return None
    labels = newest[1]
    names = [
        name.strip()
        for key in ("running_lora_adapters", "waiting_lora_adapters")
        for name in labels.get(key, "").split(",")
    ]
    return _names([name for name in names if name])


__all__ = [
    "LORA_INFO",
    "MAX_MODELS",
    "MAX_NAME",
    "MODELS_PATHS",
    "Discovered",
    "DiscoveryError",
    "lora_adapters",
    "parse_models",
]
