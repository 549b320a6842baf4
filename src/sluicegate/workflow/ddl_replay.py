"""A captured DDL statement met by the player, handled as the workflow's `--on-ddl` mode says.

The player calls `DdlReplay.met` with each 'sluicegate.ddl' message of a transaction it applies, at its place
among that transaction's rows, in the batch's open target transaction. Statements on objects that are not
tables the stream moves are passed over (logged), in every mode.

- stop: the stream stops in Error before the transaction that ran the statement (everything before it is
  applied), naming the statement; the position is recorded so that, once the statement is applied by hand and
  the workflow started again, the stream passes it. An ALTER TABLE that only adds columns is not stopped for:
  added columns follow from the Relation messages, as without capture.
- ignore: passed over. Rows after it come in the new shape and meet the Relation handling of
  schema_changes.py: added columns follow, anything else stops the stream there unless the target
  table already matches.
- exec: rows staged before it are written first (old shape), then the statement runs on the target in the same
  transaction, then rows after it (new shape), so shape, rows and position commit together. A failure stops
  the stream in Error before that transaction; a statement that cannot be replayed (ddl/statement.py) too.
- exec-ignore: as exec, but a statement that fails (or cannot be replayed) is logged, noted in the stream's
  message, and passed over.

Whether a failure is the statement's own or a passing fault (a lock wait, a lost connection, which are
retried with the batch) is decided by its SQLSTATE (errors.is_retryable), never by its text.

CREATE/DROP INDEX CONCURRENTLY runs without CONCURRENTLY on the target, inside the batch's transaction: a
concurrent build cannot run in a transaction block, and running it after the commit would leave a window in
which the stream's position says the index is there when it is not (a crash there loses it). The build
blocks writes to that target table while it runs; the only writer of a MoveTables target before cutover is
this applier, which waits for it anyway.
"""

from __future__ import annotations

import logging

import psycopg
from psycopg import sql

from ..ddl import both_ways, modes
from ..ddl.message import BadDdlMessage, DdlMessage, parse
from ..ddl.statement import NotReplayable, Statement, read, without_concurrently
from ..ddl.tables import joins
from ..ddl.touched import touched
from ..errors import is_retryable
from ..position import format_lsn
from ..postgres import locks
from ..postgres.connect import connect, first_line
from ..postgres.pgoutput import LogicalMessage
from ..postgres.relation_changes import SchemaStop
from . import ddl_tables
from . import state as st

log = logging.getLogger("sluicegate")

# Statements of types and sequences (DdlReplay._object), and the object types they name in the message
_OBJECT_TAGS = {f"{verb} {what}" for verb in ("CREATE", "ALTER", "DROP") for what in ("TYPE", "SEQUENCE")}
_OBJECT_TYPES = {"type": ("type", "composite type"), "sequence": ("sequence",)}


class DdlReplay:
    def __init__(self, dst: psycopg.Connection, target_url: str, workflow: str, stream_id: int, applier,
                 renamed: set[tuple[str, str]] = frozenset(), src: psycopg.Connection | None = None,
                 publication: str = "", follower=None, both_ways: bool = False):
        """`applier`: the batch's PostgresApplier (its rows are written before a statement runs, and it
        forgets a table's plan after one). `renamed`: source tables the target writes under another name
        (rules): statements on them are not replayed. `src`: the play task's source connection, `publication`
        the stream's (a new table joins through them, ddl_tables.py); `follower`: the batch's SchemaFollower,
        whose `changed` takes the descriptions a statement changed (the player keeps them with the batch).
        `both_ways`: a direction of an active-active pair: only what ddl/both_ways.py allows is replayed."""
        self.dst, self.target_url, self.workflow, self.stream_id = dst, target_url, workflow, stream_id
        self.both_ways = both_ways
        self.applier, self.renamed = applier, set(renamed)
        self.src, self.publication, self.follower = src, publication, follower
        self.notes: list[str] = []  # statements exec-ignore passed over in this batch: the stream's message
        # A statement changed which tables the stream has (joined, dropped, renamed): the player ends its task
        # after that transaction, and the engine reads the stream again.
        self.tables_changed = False
        # An enum label was added: the target transaction that added it cannot use it, so the batch (and the
        # task) ends after this source transaction, as for tables_changed.
        self.ends_batch = False

    # -- the player's entry -------------------------------------------------------------------------------
    def met(self, msg: LogicalMessage) -> None:
        try:
            ddl = parse(msg.content, msg.lsn)
        except BadDdlMessage as exc:
            raise SchemaStop(f"{exc}; or remove the capture (`sluicegate ddl remove`)") from None
        if ddl.tag in _OBJECT_TAGS:
            self._object(ddl)
            return
        tables = self._moved(ddl)
        mode = modes.current(self.dst, self.workflow)
        if not tables:
            new = set() if self.both_ways else self._joining(ddl)  # fixed at create (ddl/both_ways.py)
            if new and mode in (modes.EXEC, modes.EXEC_IGNORE):
                self._exec(ddl, new, ", ".join(f"{s}.{n}" for s, n in sorted(new)), mode == modes.EXEC_IGNORE)
                return
            log.debug("DDL at %s (%s) touches no table workflow %s moves: passed over",
                      format_lsn(ddl.lsn), ddl.tag, self.workflow)
            return
        names = ", ".join(f"{s}.{n}" for s, n in sorted(tables))
        if mode == modes.IGNORE:
            log.info("on-ddl ignore: passed over %s at %s on %s", ddl.tag, format_lsn(ddl.lsn), names)
            return
        if mode == modes.STOP:
            self._stop(ddl, names)
            return
        self._exec(ddl, tables, names, ignore_failure=(mode == modes.EXEC_IGNORE))

    def _joining(self, ddl: DdlMessage) -> set[tuple[str, str]]:
        """The tables a CREATE TABLE made in a schema the workflow moves whole (ddl_tables.py)."""
        if ddl.tag != "CREATE TABLE" or self.src is None or not self.publication:
            return set()
        options = self.dst.execute("SELECT options FROM sluicegate.workflows WHERE name = %s",
                                   (self.workflow,)).fetchone()[0]
        return {o.table for o in ddl.objects
                if o.object_type == "table" and o.table is not None and joins(options, *o.table)}

    # -- types and sequences --------------------------------------------------------------------------------
    def _object(self, ddl: DdlMessage) -> None:
        """CREATE TYPE/SEQUENCE in a schema that holds a moved table; ALTER and DROP of a type or sequence the
        target has (an enum's new label, say): replayed under exec and exec-ignore, so that the columns, rows
        and defaults using them apply. Others are passed over, in every mode."""
        mode = modes.current(self.dst, self.workflow)
        what = ddl.tag.split()[1].lower()  # 'type' or 'sequence'
        wanted = [o.identity for o in ddl.objects
                  if o.object_type in _OBJECT_TYPES[what] and self._object_wanted(ddl.tag, what, o)]
        if not wanted or mode not in (modes.EXEC, modes.EXEC_IGNORE):
            log.debug("DDL at %s (%s) of a %s workflow %s does not have (or --on-ddl %s): passed over",
                      format_lsn(ddl.lsn), ddl.tag, what, self.workflow, mode)
            return
        names, ignore = ", ".join(wanted), mode == modes.EXEC_IGNORE
        try:
            stmt = read(ddl.statement, ddl.tag)
        except NotReplayable as exc:
            self._failed(ddl, names, f"it cannot be replayed: {exc}", None, ignore, what)
            return
        if self.both_ways and (why := both_ways.refusal(stmt)) is not None:
            self._failed(ddl, names, f"it is not replayed: {why}", None, ignore, what)
            return
        if not self._run(ddl, stmt.text, names, ignore, what):
            return
        self.ends_batch = self.ends_batch or stmt.adds_value
        log.info("on-ddl exec: applied %s at %s to %s", ddl.tag, format_lsn(ddl.lsn), names)

    def _object_wanted(self, tag: str, what: str, o) -> bool:
        lookup = "to_regtype" if what == "type" else "to_regclass"
        has = self.dst.execute(sql.SQL("SELECT {}(%s) IS NOT NULL").format(sql.Identifier(lookup)),
                               (o.identity,)).fetchone()[0]
        if not tag.startswith("CREATE "):
            return has
        return not has and o.schema in {schema for schema, _ in self.applier.by_name}

    # -- which moved tables it touches ---------------------------------------------------------------------
    def _moved(self, ddl: DdlMessage) -> set[tuple[str, str]]:
        moved = set(self.applier.by_name)  # (schema, name) of the source tables
        found = touched(ddl, lambda s, n: (s, n) in moved)
        for o in ddl.objects:
            if o.table is None and o.object_type == "index" and o.schema and o.name:
                # a dropped index: the source's catalog no longer says whose it was; the target's does
                row = self.dst.execute(
                    """SELECT n.nspname, c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
                       JOIN pg_namespace n ON n.oid = c.relnamespace
                       WHERE i.indexrelid = to_regclass(format('%%I.%%I', %s::text, %s::text))""",
                    (o.schema, o.name)).fetchone()
                if row is not None and tuple(row) in moved:
                    found.add(tuple(row))
        return found

    # -- stop ------------------------------------------------------------------------------------------------
    def _stop(self, ddl: DdlMessage, names: str) -> None:
        at = format_lsn(ddl.lsn)
        try:
            if read(ddl.statement, ddl.tag).adds_columns_only:
                return  # added columns follow (schema_changes.py), as without capture
        except NotReplayable:
            pass
        if modes.passed(self.dst, self.workflow, self.stream_id) == at:
            log.info("on-ddl stop: %s at %s was applied by hand: passed over", ddl.tag, at)
            return
        with connect(self.target_url, role="target", autocommit=True) as own:  # outlives the batch's rollback
            modes.record_stop(own, self.workflow, self.stream_id, at)
        raise SchemaStop(
            f"a schema change of {names} at {at} (--on-ddl stop): {_quoted(ddl.statement)}; apply it on the "
            f"target by hand, then `sluicegate workflow start {self.workflow}` and `workflow run` (the stream "
            f"passes this statement then); or `sluicegate workflow set {self.workflow} --on-ddl exec` "
            f"(or ignore), then `workflow start`")

    # -- exec, exec-ignore -----------------------------------------------------------------------------------
    def _exec(self, ddl: DdlMessage, tables: set[tuple[str, str]], names: str, ignore_failure: bool) -> None:
        at = format_lsn(ddl.lsn)
        try:
            stmt = self._replayable(ddl, tables)
        except NotReplayable as exc:
            self._failed(ddl, names, f"it cannot be replayed: {exc}", None, ignore_failure)
            return
        if self.both_ways and (why := both_ways.refusal(stmt)) is not None:
            self._failed(ddl, names, f"it is not replayed: {why}. Run it here too while neither side writes "
                                     f"the table, with `--on-ddl ignore` set on both sides meanwhile",
                         None, ignore_failure)
            return
        text = without_concurrently(stmt.text) if stmt.concurrently else stmt.text
        idents = [sql.Identifier(*t).as_string(self.dst) for t in sorted(tables)]
        try:
            if not self._run(ddl, text, names, ignore_failure, "table(s)", idents,
                             lambda: self._follow(ddl, stmt, tables)):
                return
        except ddl_tables.CannotJoin as exc:
            self._failed(ddl, names, f"the table cannot join workflow {self.workflow}: {exc}", None,
                         ignore_failure)
            return
        log.info("on-ddl exec: applied %s at %s to %s", ddl.tag, at, names)

    def _run(self, ddl: DdlMessage, text: str, names: str, ignore: bool, what: str, idents=(),
             then=None) -> bool:
        """Run the statement's text on the target at its place: rows before it written first (old shape), in a
        savepoint under the source session's search_path, then `then()` in the same savepoint (undone with
        it). False when it failed (stopped or, under exec-ignore, noted); a passing fault is raised."""
        self.applier.sync()
        try:
            with locks.guard(self.dst, f"applying {ddl.tag} at {format_lsn(ddl.lsn)} to {names}", idents):
                if ddl.search_path:
                    self.dst.execute("SELECT set_config('search_path', %s, true)", (ddl.search_path,))
                self.dst.execute(text)  # no parameters: the text goes as the source ran it
                if then is not None:
                    then()
        except psycopg.Error as exc:
            if is_retryable(exc):
                raise
            self._failed(ddl, names, f"it failed on the target: {first_line(exc)}",
                         getattr(exc, "sqlstate", None), ignore, what)
            return False
        return True

    def _follow(self, ddl: DdlMessage, stmt: Statement, tables: set[tuple[str, str]]) -> None:
        """What the statement did to the stream's tables, recorded with it (ddl_tables.py)."""
        specs = {name: t.table for name, t in self.applier.by_name.items()}
        for name in sorted(tables):
            if stmt.kind == "create table":
                ddl_tables.join(self.src, self.dst, self.stream_id, self.publication, *name)
                self.tables_changed = True
                continue
            table = specs.get(name)
            if table is None:
                continue
            if stmt.kind == "drop table":
                ddl_tables.drop(self.dst, self.stream_id, table)
                self.applier.drop_table(name)
                self.tables_changed = True
            elif stmt.kind == "alter table" and self.src is not None:
                if stmt.renames_table is not None:
                    new = ddl_tables.rename(self.src, self.dst, self.stream_id, table, stmt.renames_table[2])
                    self.tables_changed = True
                else:
                    new = ddl_tables.refresh(self.src, self.dst, self.stream_id, table)
                self.applier.reshape(name, new)
                if self.follower is not None:
                    self.follower.changed[new.qualified] = new
            else:
                self.applier.forget_plan(name)

    def _replayable(self, ddl: DdlMessage, tables: set[tuple[str, str]]) -> Statement:
        renamed = sorted(f"{s}.{n}" for s, n in tables & self.renamed)
        if renamed:
            raise NotReplayable(f"the target writes {', '.join(renamed)} under other names (a rule), and "
                                f"statements are not rewritten yet")
        stmt = read(ddl.statement, ddl.tag)
        if stmt.kind == "other":
            raise NotReplayable(f"{ddl.tag} is not replayed (ALTER TABLE, CREATE/DROP INDEX, CREATE TABLE in a "
                                f"schema the workflow moves whole and DROP TABLE are)")
        if stmt.kind == "drop table":
            dropped = {(o.schema, o.name) for o in ddl.objects if o.object_type == "table"}
            if dropped - tables:
                others = ", ".join(f"{s}.{n}" for s, n in sorted(dropped - tables))
                raise NotReplayable(f"it also drops {others}, which the workflow does not move")
        return stmt

    def _failed(self, ddl: DdlMessage, names: str, why: str, sqlstate: str | None, ignore: bool,
                what: str = "table(s)") -> None:
        at = format_lsn(ddl.lsn)
        state = f" (SQLSTATE {sqlstate})" if sqlstate else ""
        if ignore:
            note = f"on-ddl exec-ignore: passed over {ddl.tag} at {at} on {names}{state}: {why}"
            log.warning("%s; statement: %s", note, ddl.statement)
            self.notes.append(note)
            st.set_message(self.dst, self.stream_id, "; ".join(self.notes))
            return
        raise SchemaStop(
            f"a schema change of {names} at {at} (--on-ddl exec): {_quoted(ddl.statement)}; {why}{state}. "
            f"Make target {what} {names} match the source by hand, then `sluicegate workflow set "
            f"{self.workflow} --on-ddl ignore` for this statement (or stop) and `sluicegate workflow start "
            f"{self.workflow}`; or re-create the workflow", sqlstate)


def _quoted(statement: str, limit: int = 300) -> str:
    one = " ".join(statement.split())
    return repr(one if len(one) <= limit else one[:limit] + "…")

