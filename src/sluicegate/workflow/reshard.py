"""Reshard: N source shards -> M target shards by key ranges over a hash of a sharding column.

Like VReplication, a stream runs per (source shard, target shard) whose key ranges overlap; each stream's
tables go through a rule that keeps only the rows of the target shard's range (intersected with the source
shard's, so a stray row on a source cannot land twice), on top of any user rule. Every target shard holds
its own streams' state, so data and position commit together in the database that receives the data. The
workflow row on each target shard lists the whole keyspace: `workflow run|status|stop|start|delete W
--target URL` with any target shard's URL acts on all of them. Streams run as threads of one driver, each
an Engine, sharing one Spark application.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

from .. import config
from ..errors import UsageError
from ..postgres import capture, catalog, locks, replication
from ..postgres.catalog import Table
from ..postgres.connect import connect, describe, strip_password, usage_errors
from ..postgres.identity import identify
from ..rules.compile import compile_rule, quote
from ..rules.spec import RuleSpec, parse_rules
from ..sharding.keyrange import KeyRange, check_partition
from ..spark.session import get_spark
from . import state as st
from .create import compile_rules, prepare_empty_target
from .create_checks import (
    check_no_leftovers,
    check_not_the_source,
    check_same_tables,
    check_source_role,
    check_table_rights,
)
from .engine import Engine
from .shards import KIND, load_all


def parse_shards(kind: str, items: list[str]) -> dict[str, str]:
    """['-80=postgresql://…', …] -> {'-80': url}, checked to cover the keyspace exactly once."""
    shards: dict[str, str] = {}
    for item in items:
        name, eq, url = item.partition("=")
        if not eq or not name.strip() or not url.strip():
            raise UsageError(f"--{kind}-shard {item.split('=')[0]!r}: expected NAME=URL, NAME a key range like -80")
        shards[str(KeyRange.parse(name))] = url.strip()
    check_partition(kind, list(shards))
    return shards


def parse_shard_keys(items: list[str]) -> dict[str, str]:
    keys = {}
    for item in items:
        table, eq, column = item.partition("=")
        if not eq or not table.strip() or not column.strip():
            raise UsageError(f"--shard-key {item!r}: expected TABLE=COLUMN")
        keys[table.strip()] = column.strip()
    return keys


def create_reshard(name: str, source_shards: dict[str, str], target_shards: dict[str, str],
                   tables: list[str] | None, shard_keys: dict[str, str], rules: list[str], options: dict,
                   udfs: dict | None = None, exclude: list[str] | None = None) -> list[str]:
    """Validate every shard and rule, then create tables and state on every target shard (all or none)."""
    st.check_name(name)
    config.check_options(options)
    specs = parse_rules(rules)
    first = next(iter(source_shards))
    with ExitStack() as stack:
        sources = {}
        for shard, url in source_shards.items():
            conn = stack.enter_context(connect(url, role="source", autocommit=True))
            with usage_errors(f"source shard {shard} ({describe(url)})"):
                capture.check_source(conn)
                superuser = check_source_role(conn)
            sources[shard] = (conn, superuser)
        described = catalog.exclude_tables(catalog.resolve_tables(sources[first][0], tables), exclude)
        catalog.refuse_keyless(described, "Reshard routes rows by a sharding column of a key; add a primary key "
                                          "on the source, or leave the table out with --exclude-tables")
        for shard, (conn, superuser) in sources.items():
            check_same_tables(shard, conn, described, first)
            if not superuser:
                check_table_rights(conn, described)
            replication.check_replication_access(source_shards[shard])
        columns = _sharding_columns(described, shard_keys)
        compiled = compile_rules(sources[first][0], specs, described, "MoveTables", udfs) if specs else {}
        compiled = {t.qualified: compiled.get(t.qualified) or _identity(t) for t in described}
        for t, c in zip(described, columns):  # each stream clears only its own rows: it must find them
            if ("raw", c) not in compiled[t.qualified].outputs:
                raise UsageError(f"the rule for {t.qualified} must keep its sharding column "
                                 f"{t.columns[c].name!r} (as is; it may be renamed)")
        plan = _streams(name, source_shards, target_shards)
        for slot, shard, _, _ in (p for streams in plan.values() for p in streams):
            check_no_leftovers(sources[shard][0], name, slot)
        # Stored without passwords: libpq's pgpass file or environment supplies them.
        keyspace = {"source_shards": {s: strip_password(u) for s, u in source_shards.items()},
                    "target_shards": {s: strip_password(u) for s, u in target_shards.items()},
                    "shard_keys": {t.qualified: t.columns[c].name for t, c in zip(described, columns)}}
        identities = {shard: identify(conn).to_json() for shard, (conn, _) in sources.items()}
        targets = {}
        for shard, url in target_shards.items():
            conn = stack.enter_context(connect(url, role="target"))
            with usage_errors(f"target shard {shard} ({describe(url)})"):
                for source_shard, (src, _) in sources.items():
                    check_not_the_source(src, conn, f"target shard {shard} (source shard {source_shard})", url)
                rels = ["sluicegate.workflows", *(compiled[t.qualified].target.ident.as_string(conn) for t in described)]
                with locks.guard(conn, f"creating workflow {name} on target shard {shard}", rels, then="try again"):
                    _prepare_target_shard(conn, name, shard, described, compiled, options, keyspace)
            targets[shard] = conn
        for shard, conn in targets.items():
            for slot, source_shard, source_url, keyrange in plan[shard]:
                rules_json = {t.qualified: compiled[t.qualified].with_keyrange(c, keyrange.lo, keyrange.hi).to_json()
                              for t, c in zip(described, columns)}
                st.add_stream(conn, name, source_shard, source_url, slot, described, rules_json,
                              identities[source_shard])
        for conn in targets.values():  # every check passed on every shard: now commit them all
            conn.commit()
    return [f"{s}: {', '.join(compiled[t.qualified].target.qualified for t in described)}" for s in target_shards]


def _identity(t: Table):
    spec = RuleSpec(t.name, f"SELECT * FROM {quote(t.name)}")
    return compile_rule(get_spark(), spec, t, t.name, t.schema, t.name)


def _streams(name: str, source_shards: dict[str, str], target_shards: dict[str, str]) -> dict[str, list]:
    """Per target shard: (slot, source shard, source URL, key range of the rows it takes) per overlapping source."""
    plan: dict[str, list] = {}
    for tname in target_shards:
        t = KeyRange.parse(tname)
        plan[tname] = [(st.object_name("sg", f"{name}/{sname}/{tname}"), sname, surl, t.intersect(KeyRange.parse(sname)))
                       for sname, surl in source_shards.items() if t.overlaps(KeyRange.parse(sname))]
    return plan


def _sharding_columns(described: list[Table], shard_keys: dict[str, str]) -> list[int]:
    names = {t.qualified for t in described} | {t.name for t in described}
    for table in shard_keys:
        if table not in names:
            raise UsageError(f"--shard-key names table {table!r}, which is not among the tables named (--tables): "
                             f"leave it out")
    out = []
    for t in described:
        column = shard_keys.get(t.qualified) or shard_keys.get(t.name) or t.key[0]
        if column not in t.column_names:
            raise UsageError(f"--shard-key {t.name}={column}: {t.qualified} has no column {column!r}")
        c = t.columns[t.column_names.index(column)]
        if not c.not_null:
            raise UsageError(f"sharding column {column!r} of {t.qualified} may be NULL, and a NULL has no shard: "
                             f"pick a NOT NULL column (the key is one)")
        out.append(t.column_names.index(column))
    return out


def _prepare_target_shard(conn, name, shard, described, compiled, options, keyspace) -> None:
    if conn.info.server_version < 140000:
        raise UsageError(f"target shard {shard} runs PostgreSQL {conn.info.server_version // 10000}; Sluicegate "
                         f"needs 14 or newer")
    st.ensure_schema(conn)
    st.check_new_name(conn, name)
    for source in described:
        prepare_empty_target(conn, compiled[source.qualified].target, KIND, f"on target shard {shard}, table")
    first_source = next(iter(keyspace["source_shards"].values()))
    st.insert_workflow(conn, name, KIND, first_source, {**options, "keyspace": keyspace, "target_shard": shard})


# -- acting on every target shard ---------------------------------------------------------------------------
def run_all(name: str, target_url: str, runner, stop: threading.Event) -> list[tuple[str, int, str]]:
    """Run every stream of every target shard, one Engine per stream in a thread, until stopped or each is
    Stopped/Error. Returns (target shard, stream id, final state) per stream."""
    copying: set[str] = set()  # (sets are thread-safe for add/discard/difference under the GIL)
    engines = [(shard, s.id, Engine(url, name, runner, stop=stop, stream_id=s.id, copying=copying))
               for shard, url, wf in load_all(name, target_url) for s in wf.streams]
    finals = run_engines([e for _, _, e in engines])
    return [(shard, sid, final) for (shard, sid, _), final in zip(engines, finals)]


def run_engines(engines: list) -> list[str]:
    """Each engine's run in a thread of its own; the final state of each, in their order ("Error: ..." for
    one that raised). By position: each target shard numbers its streams from 1, so ids repeat."""
    finals = ["stopping"] * len(engines)

    def run(i, engine):
        try:
            finals[i] = engine.run()
        except Exception as exc:  # noqa: BLE001 - reported with the others
            finals[i] = f"{st.ERROR}: {exc}"
        finally:
            engine.close()

    threads = [threading.Thread(target=run, args=(i, e), name=f"stream-{e.stream_id}", daemon=True)
               for i, e in enumerate(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return finals
