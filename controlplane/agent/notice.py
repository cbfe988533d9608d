"""Preemption notices: where the agent learns that its machine (a spot instance) goes away.

A source answers one question, "is a notice out now?", and the agent asks it every
``--notice-interval``. Once it says yes the agent drains its backends (``health: draining``
in their registrations): Envoy sends them no new request and no new session, lets requests
in flight finish, and moves their sessions to the next replica on the hash ring at once.

Sources, as ``--preemption-notice`` takes them:

- ``aws``: EC2's instance metadata, ``/latest/meta-data/spot/instance-action`` (404 until
  a notice, then 200 with the action and its time, two minutes ahead). IMDSv2 first (a
  session token from ``PUT /latest/api/token``), IMDSv1 when the token is refused.
- ``gcp``: Compute Engine's metadata, ``/computeMetadata/v1/instance/preempted`` with
  ``Metadata-Flavor: Google`` (``TRUE`` once preempted; about 30 s ahead).
- ``file:PATH``: a notice once the file exists (a node agent or a Kubernetes preStop hook
  can write it).
- ``http://...`` or ``https://...``: a notice when the URL answers 200 with a body other than
  empty, ``false``, ``0`` or ``none``; 404 means none.

The metadata services' addresses are settings (``--metadata-url``), so a test or a proxy
can stand in for them; nothing here assumes it runs in a cloud.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

AWS_METADATA = "http://169.254.169.254"
"""EC2's instance metadata service."""
GCP_METADATA = "http://metadata.google.internal"
"""Compute Engine's metadata server."""
AWS_NOTICE_PATH = "/latest/meta-data/spot/instance-action"
AWS_TOKEN_PATH = "/latest/api/token"
GCP_NOTICE_PATH = "/computeMetadata/v1/instance/preempted"
_NO = {"", "false", "0", "none", "no"}


@dataclass(frozen=True, slots=True)
class NoticeSource:
    """One place to look for a preemption notice (see the module notes for the kinds)."""

    kind: str
    """``aws``, ``gcp``, ``file`` or ``url``."""
    where: str
    """The base URL of the metadata service, the file's path or the URL."""

    @classmethod
    def parse(cls, text: str, metadata_url: str = "") -> NoticeSource:
        """A source from its flag; ``ValueError`` with a sentence for anything else."""
        if text == "aws":
            return cls("aws", (metadata_url or AWS_METADATA).rstrip("/"))
        if text == "gcp":
            return cls("gcp", (metadata_url or GCP_METADATA).rstrip("/"))
        if text.startswith("file:"):
            path = text.removeprefix("file:").removeprefix("//")
            if not path:
                raise ValueError("--preemption-notice file: needs a path, e.g. file:/run/notice")
            return cls("file", path)
        if text.startswith(("http://", "https://")):
            return cls("url", text)
        raise ValueError(
            f"--preemption-notice {text!r}: use aws, gcp, file:PATH or an http(s):// URL"
        )

    def describe(self) -> str:
        return self.where if self.kind in ("file", "url") else f"{self.kind} ({self.where})"

    async def noticed(self, http: httpx.AsyncClient) -> str | None:
        """What the notice says when one is out (its body, or the file's), else None.
        A source that cannot be read says None: no notice is known."""
        if self.kind == "file":
            return _read_notice_file(Path(self.where))
        try:
            if self.kind == "aws":
                return await self._aws(http)
            headers = {"Metadata-Flavor": "Google"} if self.kind == "gcp" else {}
            url = self.where + GCP_NOTICE_PATH if self.kind == "gcp" else self.where
            return _yes(await http.get(url, headers=headers))
        except httpx.HTTPError:
            return None

    async def _aws(self, http: httpx.AsyncClient) -> str | None:
        headers = {}
        token = await http.put(
            self.where + AWS_TOKEN_PATH,
            headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"},
        )
        if token.status_code == 200:
            headers["X-aws-ec2-metadata-token"] = token.text
        return _yes(await http.get(self.where + AWS_NOTICE_PATH, headers=headers))


def _read_notice_file(path: Path) -> str | None:
    """The notice file's first line or so; a small local file, read inline."""
    if not path.exists():
        return None
    try:
        return path.read_text(errors="replace")[:1000].strip() or "notice file present"
    except OSError:
        return "notice file present"


def _yes(response: httpx.Response) -> str | None:
    if response.status_code != 200:
        return None
    body = response.text.strip()
    return None if body.lower() in _NO else body[:1000]


__all__ = ["AWS_METADATA", "GCP_METADATA", "NoticeSource"]
