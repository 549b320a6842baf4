"""The Delta target behind `movetables create` and `workflow run|status|stop|start|delete --target delta:PATH`
(PATH a local directory or a URI delta-rs supports: location.py)."""

from __future__ import annotations

import threading
import time

import psycopg

from ... import config
from ...ddl import modes
from ...errors import SluicegateError, UsageError
from ...position import format_lsn
from ...postgres import capture
from ...postgres.connect import connect, describe, first_line, usage_errors
from ...preflight.plan import _ddl_capture
from ...rules.spec import parse_rules
from ...sizes import parse_duration
from ...spark.runner import SparkRunner
from ...spark.session import start_in_background
from ...workflow import state as pg_state
from ...workflow.create_checks import check_no_leftovers, check_source_tables
from . import location
from .rules import check_keyed, lake_table
from .sink import make_tables, start_consumer
from .state import (
    COPYING,
    ERROR,
    HOUSEKEEPING_DEFAULTS,
    INIT,
    RUNNING,
    STOPPED,
    LakeWorkflow,
    TableState,
    app_id,
    open_store,
)
from .types import arrow_schema


def create(name: str, source_url: str, target: str, tables: list[str] | None, exclude: list[str] | None,
           rules: list[str], options: dict, notes: list[str] | None = None, kind: str = "MoveTables",
           udfs: dict | None = None) -> tuple[list[str], list[str]]:
    """Check the source, the tables and the rules (compiled as for a PostgreSQL target: workflow/create.py),
    then make each empty Delta table (a rule's: of its output, rules.py) and the workflow's state.
    Returns (moved tables, lines saying what was made); `notes` gets what the Delta tables leave out."""
    from deltalake import DeltaTable

    from ...workflow.create import compile_rules

    pg_state.check_name(name)
    config.check_options(options)
    specs = parse_rules(rules)  # syntax first: no server needed to say a rule is malformed
    if kind == "Materialize" and not specs:
        raise UsageError("materialize needs at least one --rule 'TARGET: SELECT … FROM source_table …'")
    loc = location.parse(target)
    store = open_store(loc)
    if store.exists(name):
        raise UsageError(f"workflow {name!r} already exists under {loc.uri}: pick another name, or "
                         f"`sluicegate workflow delete {name} --target {target}`")
    with connect(source_url, role="source", autocommit=True) as src, \
            usage_errors(f"source {describe(source_url)}"):
        described = check_source_tables(src, source_url, tables, exclude) if kind == "MoveTables" else []
        compiled = compile_rules(src, specs, described, kind, udfs) if specs else {}
        if kind == "Materialize":  # the rules' FROM tables, checked as a MoveTables' are
            described = check_source_tables(src, source_url, [r.source.qualified for r in compiled.values()],
                                            None)
        check_no_leftovers(src, name)
        left_out = generated_columns(src, [t for t in described if t.qualified not in compiled])
        capture_note = _ddl_capture_note(src, options)
    lakes = {}  # qualified source name -> the Delta table's description
    for t in described:
        rule = compiled.get(t.qualified)
        if rule is not None:
            check_keyed(rule)
            lakes[t.qualified] = lake_table(rule)
        elif not t.key:
            raise UsageError(f"table {t.qualified} has no primary key (or unique non-null replica identity): "
                             f"a Delta target merges changes by key (tables without one, REPLICA IDENTITY FULL, "
                             f"move to PostgreSQL targets only); add one on the source")
        else:
            lakes[t.qualified] = t
    for q, lake in lakes.items():
        arrow_schema(lake)  # every column has a mapping (types.py): fails here, not at the first row
        path = loc.table(lake.schema, lake.name)
        if _is_delta(path) and DeltaTable(path).file_uris():
            raise UsageError(f"Delta table {path} already has rows: {kind} fills empty tables; "
                             f"remove it or name another target")
    if notes is not None:
        notes += capture_note
        for q, cols in left_out.items():
            notes.append(f"table {q}: generated column{'s' if len(cols) > 1 else ''} {', '.join(cols)} "
                         f"left out of its Delta table (logical replication does not send them); compute "
                         f"{'them' if len(cols) > 1 else 'it'} in the reader")
        if compiled:
            notes.append("a Delta table written through a rule follows no schema change of its source table")
    make_tables(loc, list(lakes.values()))  # (an existing one has no files: checked above)
    lines = [f"Delta table {loc.table(lake.schema, lake.name)}" for lake in lakes.values()]
    slot = pg_state.object_name("sg", name)
    states = [TableState(t.to_json(), rule=compiled[t.qualified].to_json() if t.qualified in compiled else None)
              for t in described]
    wf = LakeWorkflow(name=name, source_url=source_url, slot=slot, publication=slot, tables=states, kind=kind,
                      options=dict(options))
    store.create(wf)
    lines.append(f"state {store.describe(name)}")
    return [lakes[t.qualified].qualified for t in described], lines


def _ddl_capture_note(src, options: dict) -> list[str]:
    """--on-ddl other than stop acts only on statements the source captures (ddl/capture.py): the same check
    as a PostgreSQL target's create (preflight/plan.py), as a note."""

    mode = options.get(modes.OPTION)
    if mode is not None and mode not in modes.MODES:
        raise UsageError(f"--on-ddl {mode}: one of {', '.join(modes.MODES)}")
    return [f"{p.what}: {p.action}" for p in _ddl_capture(src, "source", modes.of(options))]


def configure(name: str, target: str, on_ddl: str | None, settings: dict) -> None:
    """`workflow set` of a Delta workflow (its DDL mode, config.tuned's settings): kept in its options; a
    running driver's play task sees the options change and ends, and the next one follows them."""
    if on_ddl is not None and on_ddl not in modes.MODES:
        raise UsageError(f"--on-ddl {on_ddl}: one of {', '.join(modes.MODES)}")
    if "idle_poll" in settings:  # (the Delta player waits for changes by its commit schedule)
        raise UsageError(f"workflow {name}: idle_poll is a PostgreSQL target's setting; this target is Delta")
    store = open_store(target)
    if not store.exists(name):
        raise UsageError(f"no workflow {name} under {location.parse(target).uri}")
    with store.update(name) as w:
        if on_ddl is not None:
            w.options[modes.OPTION] = on_ddl
        for key, value in settings.items():
            if value is None:
                w.options.pop(key, None)
            else:
                w.options[key] = value


def generated_columns(conn, tables) -> dict[str, list[str]]:
    """{table: its generated columns (stored, and PostgreSQL 18's virtual ones)}, for the tables that have any
    (describe_table leaves them out)."""
    from psycopg import sql

    out = {}
    for t in tables:
        rows = conn.execute(
            sql.SQL("""SELECT attname FROM pg_attribute WHERE attrelid = {}::regclass AND attnum > 0
                       AND NOT attisdropped AND attgenerated <> '' ORDER BY attnum""").format(
                sql.Literal(t.ident.as_string(conn)))).fetchall()
        if rows:
            out[t.qualified] = [r[0] for r in rows]
    return out


def _is_delta(uri: str) -> bool:
    """A Delta table is at `uri`; a store delta-rs cannot reach (no bucket, no credentials) is a UsageError."""
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError

    try:
        return DeltaTable.is_deltatable(uri)
    except (DeltaError, OSError) as exc:
        raise UsageError(f"target {uri}: delta-rs cannot reach it ({str(exc).splitlines()[0][:200]}); check the "
                         f"bucket and the credentials in the environment (AWS_*, AZURE_*, GOOGLE_*)") from None


def housekeeping_options(given: dict) -> dict:
    """`movetables create`'s --optimize-every, --vacuum-every, --vacuum-retention (durations, or None for the
    default) as the workflow's options, in seconds."""
    out = {}
    for key, default in HOUSEKEEPING_DEFAULTS.items():
        text = given.get(key)
        try:
            out[key] = default if text is None else parse_duration(text)
        except UsageError as exc:
            raise UsageError(f"--{key.replace('_', '-')}: {exc}") from None
    return out


def schedule(name: str, target: str, given: dict) -> dict:
    """The workflow's housekeeping schedule (seconds), after setting the options given (durations; None:
    unchanged). A running driver follows the change at its next batch."""
    changes = {k: v for k, v in housekeeping_options(given).items() if given.get(k) is not None}
    for key, seconds in changes.items():
        if key == "vacuum_retention" and seconds <= 0:
            raise UsageError("--vacuum-retention must be above zero: vacuum keeps what readers of that long need")
    store = open_store(target)
    if changes:
        with store.update(name) as w:
            w.options.update(changes)
        wf = w
    else:
        wf = store.load(name)
    return {k: float(wf.options.get(k, v)) for k, v in HOUSEKEEPING_DEFAULTS.items()}


def run(name: str, target: str, spark_master, conf: dict, stop: threading.Event, runners: list,
        progress=None) -> str:
    """`progress`: starts the progress view (cli/main.py _progress), once this driver holds the workflow."""
    from .engine import LakeEngine

    store = open_store(target)
    store.load(name)  # a typo fails before Spark starts
    engine = LakeEngine(target, name, None, stop=stop)
    engine.hold()  # so does a second driver
    governor = None
    try:
        spark = start_in_background(spark_master, conf=conf, session=False, light_jvm=True)
        runners.append(SparkRunner(spark))
        governor = start_consumer(target, name, stop)  # a Replicate sink: its bootstrap decision, the governor
    except BaseException:
        engine.lock.close()
        raise
    engine.runner = runners[0]
    view = progress() if progress is not None else None
    try:
        final = engine.run()
    finally:
        if view is not None:
            view.stop()
        if governor is not None:
            governor.close()
    if final == ERROR:
        raise SluicegateError(f"workflow {name} stopped in Error: {store.load(name).message}")
    return final


def status(name: str, target: str) -> dict:
    from deltalake import DeltaTable

    loc = location.parse(target)
    store = open_store(loc)
    wf = store.load(name)
    app = app_id(name)
    out = {"workflow": name, "kind": wf.kind, "target": loc.target, "state": wf.state, "message": wf.message,
           "position": format_lsn(wf.position) if wf.position is not None else None,
           "running": store.is_running(name), "transaction_time": wf.transaction_time,
           "consistent_point": wf.first_point, "tables": [],
           "housekeeping": {k: wf.options.get(k, v) for k, v in HOUSEKEEPING_DEFAULTS.items()}
           | {f"last_{job}": at for job, at in wf.housekeeping.items()}}
    lag_bytes = source_error = None
    try:
        with connect(wf.source_url, role="source", autocommit=True, connect_timeout=5) as src:
            flushed, _ = capture.wal_flush_position(src)
            if wf.position is not None:
                lag_bytes = max(0, flushed - wf.position)
            slot = capture.slot_info(src, wf.slot)
            out["slot"] = {"name": wf.slot, "present": slot is not None,
                           "confirmed": format_lsn(slot.confirmed_flush) if slot and slot.confirmed_flush else None}
    except (SluicegateError, psycopg.Error) as exc:
        source_error = str(exc) if isinstance(exc, SluicegateError) else first_line(exc)
    out["lag_bytes"] = lag_bytes
    out["lag_seconds"] = (round(time.time() - wf.caught_up_at, 1)
                          if wf.caught_up_at is not None and wf.state == RUNNING else None)
    if source_error:
        out["source_error"] = source_error
    for t in wf.tables:
        spec = t.lake
        path = loc.table(spec.schema, spec.name)
        version = applied = None
        if DeltaTable.is_deltatable(path):
            dt = DeltaTable(path)
            version, applied = dt.version(), dt.transaction_version(app)
        out["tables"].append({"table": spec.qualified, "path": str(path), "rows_copied": t.rows_copied,
                              "copied": t.done, "delta_version": version,
                              "applied_position": format_lsn(applied) if applied else None})
    if wf.kind == "Replicate":  # safe time, the caps, every sink's slot (sink.py)
        from .sink import status as cluster_status

        out |= cluster_status(wf, store)
    return out


def progress_streams(name: str, target: str) -> list[dict]:
    """The workflow's one stream as the progress views read a PostgreSQL target's (cli/progress.py), from the
    lake's state alone. Rows applied are not counted."""
    wf = open_store(target).load(name)
    lag = (max(0.0, time.time() - wf.caught_up_at) if wf.caught_up_at is not None and wf.state == RUNNING
           else None)
    tables = [{"table": t.qualified, "state": "Copied" if t.done else ("Copying" if t.cycles else "Pending"),
               "rows_copied": t.rows_copied,
               "rows_total": t.rows_copied if t.done else max(t.spec.estimated_rows, t.rows_copied)}
              for t in wf.tables]
    return [{"id": 1, "label": "stream 1", "state": wf.state, "message": wf.message, "lag_seconds": lag,
             "position": format_lsn(wf.position) if wf.position is not None else None, "rows_applied": None,
             "tables": tables, "source_url": wf.source_url}]  # (where a copy's running tasks show their rows)


def format_status(s: dict) -> list[str]:
    lag = []
    if s.get("lag_bytes") is not None:
        lag.append(f"{s['lag_bytes']} bytes behind the source")
    if s.get("lag_seconds") is not None:
        lag.append(f"caught up {s['lag_seconds']}s ago")
    lines = [f"workflow {s['workflow']} ({s['kind']} into {s['target']}): {s['state']}"
             + (" (driver running)" if s["running"] else "") + (f": {s['message']}" if s["message"] else ""),
             f"  position {s['position'] or '-'}" + (f"; {', '.join(lag)}" if lag else "")]
    if s.get("source_error"):
        lines.append(f"  source: {s['source_error']}")
    if "safe_time" in s:  # a Replicate sink
        lag = s["safe_time_lag_seconds"]
        lines.append(f"  sink {s['sink']}: safe time {s['safe_time'] or '-'}"
                     + (f" ({lag}s behind)" if lag is not None else ""))
        for h in s["sinks"]:
            held = h.get("retained_wal_bytes")
            held = f", holds {held} bytes of WAL" if held is not None else ""
            lines.append(f"  sink {h['sink']} ({h['url']}): slot {h['slot']}"
                         + (" present" if h.get("exists") else " absent") + held)
        lines += [f"  warning: {w}" for w in s["warnings"]]
    for t in s["tables"]:
        lines.append(f"  {t['table']}: {t['rows_copied']} rows copied{'' if t['copied'] else ' (copying)'}, "
                     f"Delta version {t['delta_version']}, applied up to {t['applied_position'] or '-'}")
    return lines


def set_state(name: str, target: str, verb: str) -> str:
    store = open_store(target)
    with store.update(name) as w:
        # A user's state change wins over a controller's stop (targets/delta/control.py): its fields go
        w.stop_reason, w.stop_position = "", None
        if verb == "stop":
            w.state = STOPPED
        else:
            if w.state not in (STOPPED, ERROR):
                return w.state
            if w.position is None:
                w.state = INIT
            elif any(not t.done for t in w.tables):
                w.state = COPYING
            else:
                w.state = RUNNING
            w.message = ""
        return w.state


def delete(name: str, target: str, drop_tables: bool = False) -> list[str]:
    """The source's slot and publication, then the state; the Delta tables too when asked."""
    from pyarrow.fs import FileType

    loc = location.parse(target)
    store = open_store(loc)
    wf = store.load(name)
    if store.is_running(name):
        raise UsageError(f"workflow {name} is being run: `sluicegate workflow stop {name} --target {target}`, "
                         f"wait for its driver to exit, then delete it")
    with connect(wf.source_url, role="source", autocommit=True) as src:
        dropped = capture.drop_capture(src, wf.slot, wf.publication)
    if drop_tables:
        for t in wf.tables:
            spec = t.lake
            path = loc.table(spec.schema, spec.name)
            fs, on_fs = location.filesystem(path)
            if fs.get_file_info(on_fs).type != FileType.NotFound:
                fs.delete_dir(on_fs)
                dropped.append(f"Delta table {path}")
    store.delete(name)
    return dropped
