"""Replicators and appliers by name (Drizzle's replication streams): a replicator transforms or filters
Transaction messages, an applier writes them somewhere. Both register as entry points
(`sluicegate.replicators`, `sluicegate.appliers` in pyproject.toml), so another package adds its own the
same way; a spec names one and its options: ``translog:dir=/var/log/sg,max_bytes=64MiB``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Protocol

from ..errors import UsageError, did_you_mean
from .model import Transaction

REPLICATORS, APPLIERS = "sluicegate.replicators", "sluicegate.appliers"


class Replicator(Protocol):
    def replicate(self, txn: Transaction) -> Transaction | None:
        """The message as it should go on (changed or not), or None to drop it."""


class Applier(Protocol):
    def apply(self, txn: Transaction) -> None:
        """Write one message. Raising stops the stream; the reader resumes from the last position applied."""

    def close(self) -> None:
        """Finish writing (flush, close files); called once at the end."""

    # Optional: `position() -> int`, everything before it durably written (0: nothing yet). A reader that is
    # not told where to start resumes from the lowest of its appliers' positions.


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'name:k=v,k2=v2' -> ('name', {'k': 'v', 'k2': 'v2'})."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"bad option {item!r} in {spec!r}: write name:key=value,key=value")
        options[key.strip()] = value.strip()
    return name.strip(), options


def names(group: str) -> list[str]:
    return sorted(ep.name for ep in entry_points(group=group))


def _load(group: str, what: str, spec: str):
    name, options = parse_spec(spec)
    found = entry_points(group=group, name=name)
    if not found:
        known = names(group)
        raise UsageError(f"unknown {what} {name!r}{did_you_mean(name, known)} (known: {', '.join(known)})")
    factory = next(iter(found)).load()
    try:
        return factory(**options)
    except TypeError as exc:  # an option the plugin does not take
        raise UsageError(f"{what} {name!r}: {exc}") from None


def load_replicator(spec: str) -> Replicator:
    return _load(REPLICATORS, "replicator", spec)


def load_applier(spec: str) -> Applier:
    return _load(APPLIERS, "applier", spec)
