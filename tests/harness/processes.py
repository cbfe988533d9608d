"""Finding the processes a test started, however deep, and telling when they are gone."""

from __future__ import annotations

from pathlib import Path


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of the running processes whose environment has `name`=`value`.

    Children inherit their parent's environment even when they start their own session, so a
    marker set on a command finds everything it started, however deep.
    """
    marker = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marker in environ.split(b"\0") and not process_gone(int(entry.name)):
            found.append(int(entry.name))
    return found
