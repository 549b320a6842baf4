"""Process liveness as this machine's PID 1 sees it."""

from __future__ import annotations

from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while the process runs. An unreaped zombie counts as gone: a daemonized postmaster is nobody's
    child here, and PID 1 reaps only lazily, so `kill(pid, 0)` would call it alive long after it exited."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
