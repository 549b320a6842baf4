"""Sinks that are not PostgreSQL databases (a Delta Lake directory), as cluster/ sees them: one interface,
`SinkKind`, implemented by the package that owns the kind (targets/delta/sink.py) and registered here, so that cluster/
never imports a target's package (issue 35: the target imports the cluster model, not the other way round).

A kind is registered as a test of the URL and a loader: the program that composes them (cli/main.py) registers
every kind it knows at start without paying for importing a kind's code until a URL of that kind turns up.
A kind's module registers itself too when it is imported, for programs that call it directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..postgres.catalog import Table
    from .model import Cluster


@dataclass
class AddedTables:
    """What `replicate add-tables` does on one sink of another kind once every sink's checks passed: the
    publication of its stream made to hold `published` (add-only), then `commit()` (its tables made, then
    recorded)."""
    publication: str
    published: list
    wanted: list[Table]
    commit: Callable[[], None]


class SinkKind(Protocol):
    label: str  # as messages name a sink of this kind: "Delta sink"

    def url(self, url: str) -> str:
        """The sink's URL as the sinks' lists hold it."""

    def check_new(self, name: str, sinks: dict[str, str], described: list[Table], overwrite: bool,
                  source_lsn: int | None) -> list:
        """`replicate create`: the bootstrap decision (create.Decision) of each table on each of `sinks`;
        UsageError on what is refused. Nothing is written."""

    def create(self, name: str, source_url: str, sinks: dict[str, str], stored: dict[str, str],
               described: list[Table], options: dict, max_retained_wal, max_retention_age) -> None:
        """`replicate create`, every check passed: each sink's tables and state."""

    def cluster(self, url: str, workflow: str) -> Cluster:
        """The cluster model the sink at `url` records for `workflow`."""

    def add_tables(self, workflow: str, sink: str, url: str, new: list[Table],
                   not_on: Callable[[str, set[str]], list[Table]], source_lsn: Callable[[], int],
                   overwrite: bool) -> tuple[list, AddedTables]:
        """`replicate add-tables` on one sink: the decisions (nothing written), and what to do once every sink's
        checks passed. `not_on(sink, have)`: the new tables the sink does not have yet; `source_lsn()`: the
        source's WAL position now (read once the sink's state is, so that nothing it records is past it)."""

    def samples(self, url: str, workflow: str) -> tuple[object, Cluster]:
        """The governor's WAL samples of the sink's consumer (governor.py), and its cluster model."""

    def alive(self, url: str, workflow: str) -> bool:
        """Whether the sink's consumer runs."""

    def tell(self, url: str, workflow: str, slot: str, message: str) -> None:
        """The governor released the sink's slot: Error with `message`, unless nothing needed the slot yet."""

    def forget(self, url: str, workflow: str, sink: str) -> None:
        """Sink `sink` of the workflow was deleted: off this sink's list."""

    def bootstrap(self, workflow: str, url: str, tables: list[str] | None) -> list[str]:
        """`replicate bootstrap` of this sink (bootstrap.py for a PostgreSQL one): what it did, one line each."""


_KINDS: list[tuple[Callable[[str], bool], Callable[[], SinkKind]]] = []


def register(owns: Callable[[str], bool], load: Callable[[], SinkKind]) -> None:
    """Sinks whose URL `owns` are of the kind `load()` returns (registering the same test again does nothing)."""
    if not any(known is owns for known, _ in _KINDS):
        _KINDS.append((owns, load))


def kind_of(url: str | None) -> SinkKind | None:
    """The kind of sink at `url`; None: a PostgreSQL database."""
    return next((load() for owns, load in _KINDS if url and owns(url)), None)


def split(sinks: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(PostgreSQL sinks, sinks of other kinds), each name -> URL, in the order given."""
    other = {s: u for s, u in sinks.items() if kind_of(u) is not None}
    return {s: u for s, u in sinks.items() if s not in other}, other


def by_kind(sinks: dict[str, str]) -> list[tuple[SinkKind, dict[str, str]]]:
    """Sinks of other kinds grouped by kind, in the order given."""
    groups: dict[int, tuple[SinkKind, dict[str, str]]] = {}
    for sink, url in sinks.items():
        kind = kind_of(url)
        groups.setdefault(id(kind), (kind, {}))[1][sink] = url
    return list(groups.values())
