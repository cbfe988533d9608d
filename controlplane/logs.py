"""Logging set-up shared by the daemons (`kvpilot serve`, `kvpilot agent`)."""

from __future__ import annotations

import logging

CHATTY_LOGGERS = ("httpx", "httpcore")
"""HTTP client libraries that log every request at INFO: an agent scraping a hundred backends
every second would drown its own log. They log at WARNING unless the level is DEBUG."""


def setup_logging(level: str) -> None:
    """One line per record, at ``level`` (debug, info, warning, error)."""
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(level=numeric, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if numeric != logging.DEBUG:
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
