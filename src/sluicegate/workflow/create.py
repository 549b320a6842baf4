"""Creating and deleting workflows: validate everything first, then create in one target transaction."""

from __future__ import annotations

import psycopg
from psycopg import sql

from .. import config
from ..ddl import capture as ddl_capture
from ..errors import SluicegateError, UsageError
from ..names import quote_name
from ..postgres import capture, catalog, locks, origins, replication, standby_flush, table_definition
from ..postgres.catalog import Table
from ..postgres.connect import (
    PGPASS_HINT,
    NoPasswordError,
    connect,
    describe,
    has_password,
    strip_password,
    usage_errors,
)
from ..postgres.identity import identify
from ..preflight.plan import Plan
from ..preflight.plan import check as preflight
from ..preflight.report import refuse
from ..rules.compile import CompiledRule, compile_rule, from_name
from ..rules.spec import RuleSpec, parse_rules
from ..spark.session import get_spark
from . import copier
from . import state as st
from .cluster_model import direction
from .create_checks import check_no_leftovers, check_not_the_source, check_source_role, check_table_rights
from .denial import undeny


def create_movetables(name: str, source_url: str, target_url: str, tables: list[str] | None,
                      rules: list[str], options: dict, udfs: dict | None = None,
                      exclude: list[str] | None = None, notes: list[str] | None = None) -> list[str]:
    """Returns the qualified names of the moved tables. Creates nothing if anything is wrong. `exclude`:
    tables not to move, among the named ones (or those of schema public). `notes`: given a list, gets a line
    for each part of a source table's definition that its target table does not get."""
    if not rules:  # a table made later in one of these schemas joins the workflow (ddl/tables.py)
        from ..ddl import tables as ddl_tables

        schemas = ddl_tables.whole_schemas(tables)
        if schemas:
            options = {**options, ddl_tables.SCHEMAS: schemas}
            if exclude:
                options[ddl_tables.EXCLUDED] = ddl_tables.qualified_names(exclude)
    return _create("MoveTables", name, source_url, target_url, tables, rules, options, udfs, exclude, notes)


def create_materialize(name: str, source_url: str, target_url: str, rules: list[str], options: dict,
                       udfs: dict | None = None) -> list[str]:
    """A workflow of rules only: each rule's source table, filtered and transformed, into its target table."""
    if not rules:
        raise UsageError("materialize needs at least one --rule 'TARGET: SELECT … FROM source_table …'")
    return _create("Materialize", name, source_url, target_url, None, rules, options, udfs)


def _create(kind: str, name: str, source_url: str, target_url: str, tables: list[str] | None, rules: list[str],
            options: dict, udfs: dict | None, exclude: list[str] | None = None,
            notes: list[str] | None = None) -> list[str]:
    st.check_name(name)
    config.check_options(options)
    specs = parse_rules(rules)  # syntax first: no server needed to say a rule is malformed
    # autocommit: the source is only read here, and must not sit idle in a transaction while the target works
    with connect(source_url, role="source", autocommit=True) as src:
        # e.g. permission denied reading a table: say which side
        with usage_errors(f"source {describe(source_url)}"):
            capture.check_source(src)
            if notes is not None and (note := ddl_capture.missing_note(src, "source", options)):
                notes.append(note)
            superuser = check_source_role(src)
            described = catalog.resolve_tables(src, tables) if kind == "MoveTables" else []
            described = catalog.exclude_tables(described, exclude)
            compiled = compile_rules(src, specs, described, kind, udfs) if specs else {}
            if compiled:  # rules replay the whole stream through Spark SQL, row by key (rule_player.py)
                catalog.refuse_keyless(described, "a workflow with rules applies changes by key; move it in a "
                                                  "workflow without --rule")
            if kind == "Materialize":
                described = [rule.source for rule in compiled.values()]
            if not superuser:
                check_table_rights(src, described)
            replication.check_replication_access(source_url)  # pg_hba.conf, REPLICATION, max_wal_senders
            # A table with a rule gets a target of the rule's shape: only the others are made in full.
            definitions = table_definition.read(src, [t for t in described if t.qualified not in compiled]) \
                if kind == "MoveTables" else {}
        # What the run will do as these users (switch-traffic's reverse stream included): refused now, not then.
        refuse(preflight(Plan(kind, [source_url], [target_url], [quote_name(t.schema, t.name) for t in described],
                              rules=bool(compiled), workflow=name, target_standbys=standby_flush.enabled(options),
                              described=described,
                              target_tables=[
                                  (compiled[t.qualified].target.schema, compiled[t.qualified].target.name)
                                  if t.qualified in compiled else (t.schema, t.name) for t in described])))
        # a database error rolls the transaction back: nothing was created
        with connect(target_url, role="target") as dst, usage_errors(f"target {describe(target_url)}"):
            check_not_the_source(src, dst, "target", target_url)
            identity = identify(src).to_json()
            lines = _create_on_target(src, dst, kind, name, source_url, described, compiled, options,
                                      identity, definitions)
    if notes is not None:
        notes.extend(lines)
    return [compiled[t.qualified].target.qualified if t.qualified in compiled else t.qualified for t in described]


def compile_rules(src: psycopg.Connection, specs: list[RuleSpec], moved: list[Table], kind: str,
                   udfs: dict | None = None) -> dict:
    """Qualified source name -> CompiledRule, each checked by Spark's analyzer against its source table."""

    spark = get_spark()
    compiled: dict[str, CompiledRule] = {}
    targets: dict[str, str] = {}
    for spec in specs:
        view = from_name(spark, spec)
        if spec.is_pattern:
            if view != spec.target:
                raise UsageError(f"rule {spec.label} matches tables by pattern: its FROM names the same pattern, "
                                 f"in backquotes (FROM `{spec.target}`)")
            if moved:
                sources = [t for t in moved if spec.matches(t.schema, t.name)]
            else:
                sources = [catalog.describe_table(src, s, n) for s, n in catalog.list_tables(src) if spec.matches(s, n)]
            if not sources:
                raise UsageError(f"rule {spec.label} matches no source table")
            pairs = [(t, t.schema, t.name) for t in sources]
        else:
            if "." in view:
                raise UsageError(f"rule {spec.label}: name the source table without its schema in FROM "
                                 f"({view.rsplit('.', 1)[-1]}); a table outside schema public is found by name")
            source = catalog.resolve_tables(src, [view])[0]
            if kind == "MoveTables" and source.qualified not in {t.qualified for t in moved}:
                raise UsageError(f"rule {spec.label} reads {source.qualified}, which this workflow does not move: "
                                 f"add it to --tables")
            schema, rel = catalog.split_name(spec.target)
            pairs = [(source, schema or source.schema, rel)]
        for source, schema, rel in pairs:
            if source.qualified in compiled:
                raise UsageError(f"source table {source.qualified} has two rules ({compiled[source.qualified].rule.split(':')[0]!r} "
                                 f"and {spec.label}): one rule per source table")
            rule = compile_rule(spark, spec, source, view, schema, rel, udfs)
            if rule.target.qualified in targets:
                raise UsageError(f"rules {targets[rule.target.qualified]!r} and {spec.label} both write "
                                 f"{rule.target.qualified}: one source table per target table")
            targets[rule.target.qualified] = spec.target
            compiled[source.qualified] = rule
    return compiled


def _create_on_target(src: psycopg.Connection, dst: psycopg.Connection, kind: str, name: str, source_url: str,
                      described: list[Table], compiled: dict, options: dict, source_identity: dict,
                      definitions: dict) -> list[str]:
    """Every check first, then target tables and state, all in one target transaction. `definitions`: the
    source tables' TableDefinitions by qualified name, for the target tables made in full. Returns what the
    target tables do not get of their source's definition, a line each."""
    if dst.info.server_version < 140000:
        raise UsageError(f"target runs PostgreSQL {dst.info.server_version // 10000}; Sluicegate needs 14 or newer")
    if compiled:  # an existing target table's columns may be wider than a rule's output, never narrower
        from ..rules.compile import fit_existing_target

        compiled = {q: fit_existing_target(dst, rule) for q, rule in compiled.items()}
    targets = [compiled[s.qualified].target if s.qualified in compiled else s for s in described]
    rels = ["sluicegate.workflows", *(t.ident.as_string(dst) for t in targets)]
    with dst.transaction(), locks.guard(dst, f"creating workflow {name}", rels, then="try again"):
        st.ensure_schema(dst)
        st.check_new_name(dst, name)  # before the slower checks: the likeliest mistake
        check_no_leftovers(src, name)
        created = {}
        for target in targets:
            definition = definitions.get(target.qualified)
            if prepare_empty_target(dst, target, kind, "target table", definition) and definition:
                created[target.qualified] = definition
        lines, options = _target_definition_notes(definitions, created, compiled, options, dst.info.user,
                                                  lambda: table_definition.may_apply_as_replica(dst))
        st.insert_workflow(dst, name, kind, source_url, options)
        st.add_stream(dst, name, "0", None, st.object_name("sg", name), described,
                      {q: rule.to_json() for q, rule in compiled.items()}, source_identity)
    return lines


def _target_definition_notes(definitions: dict, created: dict, compiled: dict, options: dict, user: str,
                             may_apply_as_replica) -> tuple[list[str], dict]:
    """What the target tables do not get, a line each, and the workflow's options with the foreign keys to add
    once every table is copied (engine.py): those between two tables made here, when the applier may run with
    session_replication_role = replica (a child row may be applied before its parent), which
    `may_apply_as_replica()` says of the target `user`."""
    lines = []
    pending = []
    replica = None
    for qualified, d in definitions.items():
        if qualified not in created:
            lines.append(f"table {qualified}: exists on the target and keeps its own definition (nothing added)")
            continue
        lines.extend(d.not_carried)
        for fk in d.foreign_keys:
            why = ""
            if compiled:
                why = "a workflow with rules does not carry foreign keys"
            elif fk.references not in created:
                why = f"{fk.references} exists on the target and keeps its own definition"
            else:
                replica = may_apply_as_replica() if replica is None else replica
                if not replica:
                    why = (f"target user {user} may not SET session_replication_role, which applying changes with "
                           f"the key in place takes (a child row may come before its parent): GRANT SET ON "
                           f"PARAMETER session_replication_role TO {user} (PostgreSQL 15+, as a superuser) and "
                           f"create the workflow again, or add it after the switch")
            if why:
                lines.append(f"table {qualified}: foreign key {fk.name} ({fk.definition}) not carried: {why}")
            else:
                pending.append({"table": qualified, "name": fk.name, "definition": fk.definition})
    if pending:
        options = {**options, "foreign_keys": pending, "apply_as_replica": True}
    return lines, options


def source_password_note(source_url: str) -> str | None:
    """A note for `create` when the source URL holds a password that libpq cannot find by itself: the
    password is not stored, so `workflow run` will need it in a pgpass file, a service file or PGPASSWORD."""
    if not has_password(source_url):
        return None
    try:
        connect(strip_password(source_url), role="source", connect_timeout=5).close()
        return None
    except NoPasswordError:
        return (f"note: the source password is not stored; `workflow run`, `vdiff` and `status` need it from "
                f"libpq: {PGPASS_HINT.split(': Sluicegate')[0]}")
    except SluicegateError:
        return None  # something else (the server is going away): run says what


def prepare_empty_target(dst: psycopg.Connection, t: Table, kind: str, where: str, definition=None) -> bool:
    """Create the target table (in full, given the source's TableDefinition), or check an existing one is
    compatible and empty (a workflow fills it). True if created."""
    created = catalog.prepare_target(dst, t, definition)
    if not created and dst.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(t.ident)).fetchone()[0]:
        raise UsageError(f"{where} {t.qualified} already has rows: {kind} fills empty tables; "
                         f"empty it (TRUNCATE) or drop it first")
    return created


def delete_workflow(name: str, target_url: str) -> list[str]:
    """Drop the source's slot and publication, then the state. The target tables stay, with their indexes."""
    with connect(target_url, role="target") as dst:
        wf = st.load_workflow(dst, name)
        for s in wf.streams:  # a copy stopped in its first cycle: the target table gets its indexes back
            for t in s.tables:
                if t.deferred_indexes and dst.execute("SELECT to_regclass(%s)",
                                                      (t.table.ident.as_string(dst),)).fetchone()[0]:
                    copier.build_deferred_indexes(dst, s.id, t)
    dropped: list[str] = []
    for s in wf.streams:
        with connect(s.source_url, role="source", autocommit=True) as src:
            dropped += capture.drop_capture(src, s.slot_name, s.publication)
    origin, _ = direction(wf)
    with connect(target_url, role="target") as dst:
        if origin:  # a bidirectional side: the application's deletes stop leaving tombstones
            from ..appliers.lww import remove_tombstone_triggers

            for s in wf.streams:
                for t in s.tables:
                    if dst.execute("SELECT to_regclass(%s)", (t.table.ident.as_string(dst),)).fetchone()[0]:
                        remove_tombstone_triggers(dst, t.table)
                        dropped += undeny(dst, [t.table])  # a copy that never finished
        st.delete_workflow(dst, name)
    if origin:  # the origin this sink's writes carried (a bidirectional Replicate's)
        with connect(target_url, role="target", autocommit=True) as dst:
            dropped += origins.drop(dst, origin)
    return dropped
