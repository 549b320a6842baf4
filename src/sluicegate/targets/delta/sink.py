"""A Delta Lake sink of a Replicate workflow (`--sink delta:PATH`): cluster/ reaches it through its sink interface
(cluster/sinks.py, `DELTA` below), without importing targets/delta/.

Its state is the lake's state document (targets/delta/state.py) with kind Replicate and `options["cluster"]` as a
PostgreSQL sink's row holds it, so the cluster model (cluster/model.py) serves both: names s1, s2, …, one slot and
publication per sink (`slot_name(W, sink)`), the same bootstrap command and way out. The consumer is the lake
engine (engine.py); around it, as for a PostgreSQL sink: the bootstrap decision at start, safe time (kept
in the state document, only growing), and the retention governor over every sink's slot. The governor's WAL
samples live in the state document too, so a Delta sink needs no PostgreSQL sink beside it.

`replicate bootstrap` of a Delta sink re-copies its tables. A copy's first cycle replaces the table's rows in
its commit (engine.py), so nothing stale survives. Cycle numbers keep counting across copies (the copy's
app transaction version is the cycle number, and a re-copy restarting at 1 would look done), and each
table's skip threshold becomes the new copy's snapshot position, which is past anything applied before.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from ...cluster import governor, sinks
from ...cluster.bootstrap import _resolve
from ...cluster.create import new_table_decision
from ...cluster.model import KIND, Cluster, slot_name
from ...cluster.safetime import lake_safe_time_fields
from ...errors import SluicegateError, TerminalError, UsageError
from ...position import format_lsn
from ...postgres import capture
from ...postgres.catalog import Table
from ...postgres.connect import connect, describe
from ...sizes import format_size
from . import location
from .state import (
    COPYING,
    ERROR,
    INIT,
    RUNNING,
    STOPPED,
    LakeWorkflow,
    TableState,
    app_id,
    open_store,
    update_retrying,
)

if TYPE_CHECKING:
    from .state import DeltaStore, Store

    StateStore = Store | DeltaStore

ALIVE_SECONDS = 30.0  # a state document written this recently (a running one writes it each second)


def sink_url(target: str) -> str:
    """A Delta sink as the sinks' lists hold it: delta: and the absolute directory or the URI."""
    return location.parse(target).target


def check_sinks(name: str, delta: dict[str, str], described: list[Table], overwrite: bool,
                source_lsn: int | None = None) -> list:
    """The bootstrap decision of each Delta sink's tables (create.Decision); raises UsageError on what is
    refused outright. Nothing is written. `source_lsn`: the source's WAL position now, which every change
    the new workflow applies comes after."""
    if delta:  # PostgreSQL sinks take any table (keyless ones too)
        check_mappable(described)
    seen: dict = {}
    out = []
    for sink, url in delta.items():
        root = location.parse(url)
        if root in seen:
            raise UsageError(f"sinks {seen[root]} and {sink} are the same Delta directory {root.uri}: name each "
                             f"sink once")
        seen[root] = sink
        if open_store(root).exists(name):
            raise UsageError(f"sink {sink} ({url}) already holds workflow {name!r}: pick another name, or "
                             f"`sluicegate workflow delete {name} --target {url}`")
        out += table_decisions(name, sink, url, described, overwrite, source_lsn)
    return out


def check_mappable(described: list[Table]) -> None:
    """Tables a Delta sink can hold: a key to merge by, and a Delta type for every column."""
    from .types import arrow_schema  # (pyarrow: once a Delta sink is met)

    for t in described:
        if not t.key:
            raise UsageError(f"table {t.qualified} has no primary key (or unique non-null replica identity): "
                             f"a Delta sink merges changes by key (tables without one, REPLICA IDENTITY FULL, "
                             f"move to PostgreSQL sinks only); add one on the source or leave the table out")
        arrow_schema(t)  # every column has a mapping (targets/delta/types.py): fails here, not at the first row


def table_decisions(name: str, sink: str, url: str, described: list[Table], overwrite: bool,
                    source_lsn: int | None) -> list:
    """The chart for tables new to workflow `name` on one Delta sink (at create or add-tables); raises
    UsageError when another workflow of the sink writes one of them. Nothing is written."""
    from deltalake import DeltaTable

    root = location.parse(url)
    store = open_store(root)
    mine = {t.qualified for t in described}
    for other in store.names():
        taken = mine & {t.qualified for t in store.load(other).tables} if other != name else set()
        if taken:
            raise UsageError(f"sink {sink} ({url}) is already the target of workflow {other!r}, "
                             f"which writes {min(taken)}: one workflow per sink table; delete "
                             f"{other!r} or leave the table out")
    out = []
    for t in described:
        path = root.table(t.schema, t.name)
        if DeltaTable.is_deltatable(path) and source_lsn is not None:
            # An earlier workflow of this name committed changes up to this position: the player skips
            # what a table already has by that version, so a new one must start past it.
            have = DeltaTable(path).transaction_version(app_id(name))
            if have is not None and have > source_lsn:
                raise UsageError(f"sink {sink}: Delta table {path} holds changes of an earlier workflow "
                                 f"{name!r} up to {format_lsn(have)}, past the source's position "
                                 f"{format_lsn(source_lsn)}: changes would be skipped; remove the table "
                                 f"or pick another workflow name")
        created = not DeltaTable.is_deltatable(path)  # (made by make_tables, once every check passed)
        empty = created or not _has_rows(DeltaTable(path))
        out.append(new_table_decision(sink, url, t.qualified, created, empty, overwrite, "Delta table"))
    return out


def _has_rows(dt) -> bool:
    return bool(dt.file_uris()) and dt.to_pyarrow_dataset().count_rows() > 0


def create_sinks(name: str, source_url: str, delta: dict[str, str], stored: dict[str, str],
                 described: list[Table], options: dict, max_retained_wal, max_retention_age) -> None:
    """Each Delta sink's tables (make_tables) and state."""
    for sink, url in delta.items():
        root = location.parse(url)
        make_tables(root, described)
        cluster = Cluster(name, source_url, stored, sink, max_retained_wal, max_retention_age)
        slot = slot_name(name, sink)
        open_store(root).create(LakeWorkflow(name=name, source_url=source_url, slot=slot, publication=slot,
                                        tables=[TableState(t.to_json()) for t in described], kind=KIND,
                                        options={**options, "cluster": cluster.to_json()}))


def make_tables(root: location.Location, described: list[Table]) -> None:
    """Each table's Delta table: a missing one made, an empty one's schema made the source's; one kept with
    its rows (--overwrite) has them replaced by the copy's first commit."""
    from deltalake import DeltaTable

    from .types import arrow_schema

    for t in described:
        path = root.table(t.schema, t.name)
        if not DeltaTable.is_deltatable(path):
            if root.local:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            DeltaTable.create(path, arrow_schema(t), mode="error", name=t.qualified)
        elif not _has_rows(DeltaTable(path)):
            DeltaTable.create(path, arrow_schema(t), mode="overwrite", name=t.qualified)


def append_tables(store: StateStore, workflow: str, wanted: list[Table]) -> None:
    """`replicate add-tables` on a Delta sink, after the tables joined the publication: they are recorded
    not copied; a running stream goes back to Copying (its play task returns at its next batch, the engine
    copies them, then replays from its checkpoint, each new table skipping what its copy had). No point is
    recorded until the stream has passed the new copies (player.py), so readers keep the last one before."""
    def append(w: LakeWorkflow) -> None:
        have = {t.qualified for t in w.tables}
        w.tables += [TableState(t.to_json()) for t in wanted if t.qualified not in have]
        if w.state == RUNNING:
            w.state, w.message = COPYING, ""
        w.first_point = False

    # (decided on the state, Running or not: a consumer's commit of another state meanwhile is a collision)
    update_retrying(store, workflow, append, depends=(("state",),))


def at_start(target: str, name: str) -> list[str]:
    """The seed's decision for an existing setup, at the consumer's start (decisions.py for a Delta sink):
    one line; a slot that cannot supply the checkpoint puts the sink in Error with the bootstrap command."""
    store = open_store(target)
    wf = store.load(name)
    cluster = Cluster.of(wf)
    here = f"sink {cluster.sink}"
    if wf.state == INIT:
        if wf.message.startswith("re-bootstrap"):
            return [f"{here}: {wf.message}: copying {len(wf.tables)} table(s) from the source again"]
        return [f"{here}: new setup: bootstrap by a copy of {len(wf.tables)} table(s) from the source"]
    if wf.state in (STOPPED, ERROR):
        return [f"{here}: stream is {wf.state}{': ' + wf.message if wf.message else ''}"]
    try:
        src = connect(wf.source_url, role="source", autocommit=True, connect_timeout=10)
    except SluicegateError as exc:
        return [f"{here}: cannot ask the source yet ({exc}); the consumer retries"]
    with src:
        try:
            info = capture.check_slot(src, wf.slot, wf.position, cluster.way_out(),
                                      consumer=f"sink {cluster.sink}'s checkpoint")
        except TerminalError as exc:
            with store.update(name) as w:
                if w.state not in (STOPPED, ERROR):
                    w.state, w.message = ERROR, str(exc)
            return [f"{here}: cannot resume: {exc}"]
        held, _ = capture.retained_wal(src, wf.slot)
    line = (f"{here}: resume from checkpoint {format_lsn(wf.position)}: slot {wf.slot} present, WAL kept "
            f"from {format_lsn(info.restart_lsn)} ({format_size(held or 0)})")
    pending = [t.qualified for t in wf.tables if not t.done]
    if pending:
        line += f"; copying {', '.join(pending)} (bootstrap in progress)"
    return [line]


def start_consumer(target: str, name: str, stop):
    """What `workflow run` does around a Delta sink's engine: print the decision, start the governor (its
    `close` when the engine returns). None for a MoveTables."""
    wf = open_store(target).load(name)
    if wf.kind != KIND:
        return None
    for line in at_start(target, name):
        print(line, file=sys.stderr, flush=True)
    return governor.Governor(target, name, stop).start()


class LakeSamples:
    """The governor's samples of the source's WAL position, in a Delta sink's state document."""

    def __init__(self, store: StateStore, workflow: str):
        self.store, self.workflow = store, workflow

    def add(self, lsn: int, now: datetime, every: timedelta, keep: timedelta) -> None:
        samples = self.store.load(self.workflow).wal_samples
        t = now.timestamp()
        if samples and t - samples[-1][1] < every.total_seconds():
            return
        with self.store.update(self.workflow) as w:
            w.wal_samples = [s for s in w.wal_samples if t - s[1] < keep.total_seconds()] + [[lsn, t]]

    def age(self, restart: int, now: datetime) -> float:
        """Seconds since the first sample past `restart` (0 if none is)."""
        after = [t for lsn, t in self.store.load(self.workflow).wal_samples if lsn > restart]
        return max(0.0, now.timestamp() - min(after)) if after else 0.0


def consumer_alive(url: str, workflow: str) -> bool:
    """A Delta sink's consumer holds the run lock (this host), or wrote its state document lately."""
    try:
        store = open_store(url)
        return store.is_running(workflow) or time.time() - store.load(workflow).updated_at < ALIVE_SECONDS
    except Exception:  # noqa: BLE001 - unreachable, or deleted there: nothing beats
        return False


def tell_sink(url: str, workflow: str, slot: str, message: str) -> None:
    """The governor released this sink's slot: Error with the reason, unless nothing needed the slot yet."""
    with open_store(url).update(workflow) as w:
        if w.slot == slot and w.position is not None and w.state not in (ERROR, INIT):
            w.state, w.message = ERROR, message


def forget(url: str, workflow: str, sink: str) -> None:
    store = open_store(url)
    if store.exists(workflow):
        with store.update(workflow) as w:
            if w.kind == KIND:
                w.options["cluster"]["sinks"].pop(sink, None)


def status(wf: LakeWorkflow, store: StateStore) -> dict:
    """What a PostgreSQL sink's status adds for Replicate (status.py): safe time, caps, every sink's slot."""
    cluster = Cluster.of(wf)
    warnings, holds, source_now, published = [], [], None, set()
    try:
        with connect(cluster.source_url, role="source", autocommit=True, connect_timeout=3) as src:
            source_now = src.execute("SELECT clock_timestamp()").fetchone()[0]
            holds = governor.holds(src, LakeSamples(store, wf.name), cluster)
            published = {r[0] for r in src.execute(
                "SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)",
                ([cluster.slot(s) for s in cluster.sinks],))}
    except (SluicegateError, psycopg.Error) as exc:
        warnings.append(f"source {describe(cluster.source_url)}: {str(exc).splitlines()[0]}")
    sinks = []
    for sink, url in cluster.sinks.items():
        hold = next((h for h in holds if h.sink == sink), None)
        entry = {"sink": sink, "url": url, "this": sink == cluster.sink, "slot": cluster.slot(sink)}
        if hold is not None:
            entry.update(hold.to_json())
            entry["not_yet_run"] = not hold.exists and hold.slot not in published
            if not hold.exists and (hold.released or not entry["not_yet_run"]):
                why = f" ({hold.released})" if hold.released else ""
                warnings.append(f"sink {sink}: its replication slot {hold.slot} is gone from the "
                                f"source{why}; `{cluster.bootstrap_command(sink)}` brings it back")
        sinks.append(entry)
    caps = {"max_retained_wal": format_size(cluster.max_retained_wal) if cluster.max_retained_wal else None,
            "max_retention_age_seconds": cluster.max_retention_age}
    return {**lake_safe_time_fields(wf.safe_time, source_now), "sink": cluster.sink, "caps": caps,
            "sinks": sinks, "warnings": warnings}


def bootstrap(workflow: str, target: str, tables: list[str] | None) -> list[str]:
    """`replicate bootstrap` of a Delta sink (bootstrap.py for a PostgreSQL one): a slot that cannot supply
    the checkpoint is made again and every table re-copied (its consumer stopped); with a healthy slot, only the
    tables named, while its consumer runs if it does."""
    store = open_store(target)
    wf = store.load(workflow)
    cluster = Cluster.of(wf)
    running = store.is_running(workflow)
    stop_first = (f"stop its consumer (`sluicegate workflow stop {workflow} --target {target}`) and bootstrap "
                  f"again")
    here = f"sink {cluster.sink} ({target})"
    names = {t.qualified for t in wf.tables}
    chosen = _resolve(tables, names) if tables else None
    with connect(wf.source_url, role="source", autocommit=True) as src:
        why = None
        if wf.position is None:
            why = None if wf.state == INIT else f"stream is {wf.state} with no checkpoint"
        else:
            info = capture.slot_info(src, wf.slot)
            if running:  # its consumer records its checkpoint, then confirms the slot: read the slot first
                wf = store.load(workflow)
            try:
                capture.judge_slot(src, wf.slot, info, wf.position, "", "the sink's checkpoint")
            except SluicegateError as exc:
                why = str(exc).rstrip("; ")
        if why is None and wf.state == INIT:
            return [f"{here}: nothing to bootstrap: the stream has not started; `workflow run` copies"]
        if why is not None:
            if running:  # its slot is made again: the consumer must not be reading it
                raise UsageError(f"workflow {workflow} is being run on {here}, whose slot cannot resume "
                                 f"({why}): {stop_first}")
            capture.drop_capture(src, wf.slot, wf.publication)
            with store.update(workflow) as w:
                _reset(w, names)
                w.state, w.position, w.message = INIT, None, f"re-bootstrap: {why}"
            lines = [f"{here}, table {t}: copy (re-bootstrap: {why})" for t in sorted(names)]
            if chosen and set(chosen) != names:
                lines.append(f"{here}: every table is re-copied, not only {', '.join(chosen)}: the slot lost "
                             f"changes to all of them")
            return lines
    if not chosen:
        return [(f"{here}: nothing to bootstrap: every table resumes from checkpoint (the slot can supply "
                 f"them); name tables with --tables to re-copy them anyway")]

    def recopy(w: LakeWorkflow) -> None:
        # A running consumer copies them at its next batch, as for add-tables. Not in the middle of a copy:
        # its progress would be written over the reset.
        if running and w.state != RUNNING:
            raise UsageError(f"workflow {workflow} is {w.state} on {here}: run the bootstrap again once it is "
                             f"Running, or {stop_first}")
        _reset(w, set(chosen))
        w.state, w.message = COPYING, ""

    update_retrying(store, workflow, recopy, depends=(("state",),))
    lines = [f"{here}, table {t}: copy (re-bootstrap asked for)" for t in chosen]
    others = sorted(names - set(chosen))
    if others:
        lines.append(f"{here}: {', '.join(others)} resume from checkpoint (the slot can supply them)")
    return lines


def _reset(w: LakeWorkflow, tables: set[str]) -> None:
    """The tables copied again: `cycles` keeps counting (see the module's docstring); no consistent point
    until the stream has passed the new copies' snapshots."""
    for t in w.tables:
        if t.qualified in tables:
            t.lastpk, t.done, t.rows_copied, t.copy_from, t.copied_to = None, False, 0, None, None
    w.first_point = False


class DeltaSink:
    """The Delta sink as cluster/ calls it (cluster/sinks.SinkKind)."""

    label = "Delta sink"
    url = staticmethod(sink_url)
    create = staticmethod(create_sinks)
    tell = staticmethod(tell_sink)
    alive = staticmethod(consumer_alive)
    forget = staticmethod(forget)
    bootstrap = staticmethod(bootstrap)
    check_new = staticmethod(check_sinks)

    @staticmethod
    def cluster(url: str, workflow: str) -> Cluster:
        return Cluster.of(open_store(url).load(workflow))

    @staticmethod
    def add_tables(workflow: str, sink: str, url: str, new: list[Table], not_on, source_lsn,
                   overwrite: bool) -> tuple[list, sinks.AddedTables]:
        check_mappable(new)
        store = open_store(url)
        wf = store.load(workflow)
        wanted = not_on(sink, {t.qualified for t in wf.tables})
        decisions = table_decisions(workflow, sink, url, wanted, overwrite, source_lsn())

        def commit() -> None:  # its new tables made, then recorded (append_tables)
            make_tables(location.parse(url), wanted)
            append_tables(store, workflow, wanted)

        return decisions, sinks.AddedTables(wf.publication, [t.spec for t in wf.tables] + wanted, wanted, commit)

    @staticmethod
    def samples(url: str, workflow: str) -> tuple[LakeSamples, Cluster]:
        store = open_store(url)
        return LakeSamples(store, workflow), Cluster.of(store.load(workflow))


DELTA = DeltaSink()
sinks.register(location.is_delta, lambda: DELTA)
