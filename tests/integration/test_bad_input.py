"""Bad input through the real CLI: one `error:` line naming the object and the way out, exit != 0,
no traceback, no password in the output, and nothing half-created on source or target.

No Spark here: every command must fail (or answer) before a Spark session would start.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql

from sluicegate.localpg import LocalPostgres
from sluicegate.workflow.state import object_name

ROLE = f"sgbad_{os.getpid()}"
PLAIN = f"sgbad_{os.getpid()}_plain"  # no superuser: for the source's privilege checks
# Distinctive, so "never in the output" is a real check (the fixtures' password is the program's name).
PASSWORD = "Pw-" + secrets.token_hex(8)
WRONG = "Wrong-" + secrets.token_hex(8)


def _create_role(server: LocalPostgres) -> None:
    server.psql(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
        sql.Identifier(ROLE), sql.Literal(PASSWORD)))


@pytest.fixture(scope="module", autouse=True)
def role(source_server, target_server):
    """A login with a distinctive password on both servers. Dropped after the pairs' databases are gone."""
    for server in (source_server, target_server):
        _create_role(server)
    source_server.psql(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
        sql.Identifier(PLAIN), sql.Literal(PASSWORD)))
    yield
    for server in (source_server, target_server):
        for name in (ROLE, PLAIN):
            server.psql(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def url(server: LocalPostgres, dbname: str, password: str = PASSWORD, port: int | None = None,
        user: str = ROLE) -> str:
    return f"postgresql://{user}:{quote(password, safe='')}@127.0.0.1:{port or server.port}/{quote(dbname)}"


def dead_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sg(*args: str, target: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a fresh interpreter, without an inherited SLUICEGATE_TARGET."""
    environ = {k: v for k, v in os.environ.items() if k != "SLUICEGATE_TARGET"}
    environ.update(env or {})
    cmd = [sys.executable, "-m", "sluicegate.cli.main", *args]
    if target is not None:
        cmd += ["--target", target]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=60,
                          stdin=subprocess.DEVNULL, check=False)
    for secret in (PASSWORD, WRONG):
        assert secret not in proc.stdout + proc.stderr, f"password printed by {args}: {proc.stderr}"
    return proc


def parallel(*calls):
    """Independent CLI runs at once (each is mostly interpreter start-up); their results in order."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def timed(call):
    started = time.monotonic()
    return call(), time.monotonic() - started


# If `workflow run` started Spark before looking the workflow up, it would fail on this Java instead.
NO_JAVA = {"JAVA_HOME": "/nonexistent-java-home"}


def failed(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The one error line, after checking its form and that it names every needle."""
    assert proc.returncode != 0, f"expected failure, got exit 0: {proc.stdout}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line: {proc.stderr!r}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} missing from {lines[0]!r}"
    return lines[0]


def create(pair, workflow: str, tables: str | None, source: str | None = None,
           target: str | None = None) -> subprocess.CompletedProcess:
    args = ["movetables", "create", "--workflow", workflow,
            "--source", source or url(pair.source_server, pair.name)]
    if tables is not None:
        args += ["--tables", tables]
    return sg(*args, target=target or url(pair.target_server, pair.name))


def target_tables(pair) -> list[str]:
    return [r[0] for r in pair.dst(
        """SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema')
           ORDER BY 1""")]


def assert_nothing_created(pair, tables_before: list[str], workflows_before: list = ()) -> None:
    """No new target table, no (new) workflow state, no slot or publication on the source."""
    assert target_tables(pair) == tables_before
    if pair.dst("SELECT to_regclass('sluicegate.workflows')")[0][0] is None:
        assert not workflows_before
    else:
        assert workflow_state(pair) == list(workflows_before)
    assert pair.src("SELECT slot_name FROM pg_replication_slots WHERE database = current_database()") == []
    assert pair.src("SELECT pubname FROM pg_publication") == []


def workflow_state(pair) -> list:
    """Everything Sluicegate keeps on the target, as comparable rows."""
    return pair.dst(
        """SELECT w.name, w.kind, w.options::text, w.created_at, s.id, s.state, s.message, s.position::text,
                  s.updated_at, c.table_name, c.spec::text, c.lastpk::text, c.rows_copied, c.done
           FROM sluicegate.workflows w JOIN sluicegate.streams s ON s.workflow = w.name
           JOIN sluicegate.copy_state c ON c.stream_id = s.id ORDER BY w.name, s.id, c.table_name""")


def test_source_tables_that_cannot_move(pair):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int)")
    pair.src("CREATE TABLE nokey (a int, b text)")
    pair.src("CREATE TABLE nullable_unique (a int UNIQUE, b text)")  # NULLs repeat: not a key
    pair.src("CREATE TABLE ukey (code text NOT NULL, b text)")
    pair.src("CREATE UNIQUE INDEX ukey_code ON ukey (code)")
    before = target_tables(pair)

    cases = {
        "nokey": ["public.nokey", "primary key"],
        "nullable_unique": ["public.nullable_unique", "primary key"],
        "ukey": ["public.ukey", "ALTER TABLE public.ukey REPLICA IDENTITY USING INDEX ukey_code"],
        "items,nokey": ["public.nokey"],  # the first is fine: still nothing is created for it
        None: ["public."],  # the default, all of schema public, has the bad tables too
        "itemz": ["'itemz'", "did you mean 'items'"],
        " , ": ["--tables"],  # an empty list must not mean "all tables"
    }
    procs = parallel(*[lambda t=t: create(pair, "wf", t) for t in cases])
    for proc, needles in zip(procs, cases.values()):
        failed(proc, *needles)
    assert_nothing_created(pair, before)

    # once the index is the replica identity, ukey moves (and its key is that index)
    pair.src("ALTER TABLE ukey REPLICA IDENTITY USING INDEX ukey_code")
    ok = create(pair, "wf", "ukey")
    assert ok.returncode == 0, ok.stderr
    assert "public.ukey" in ok.stdout
    spec = pair.dst("SELECT spec FROM sluicegate.copy_state")[0][0]
    assert spec["key"] == ["code"]


def test_target_tables_that_cannot_take_the_rows(pair):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int)")
    pair.src("CREATE TABLE notes (id bigint PRIMARY KEY, body text)")
    pair.src("INSERT INTO items VALUES (1, 1)")
    pair.dst("CREATE TABLE notes (id bigint PRIMARY KEY, body integer)")
    before = target_tables(pair)
    assert before == ["public.notes"]

    # items validates (and would be created), notes does not: items must not exist afterwards
    failed(create(pair, "wf", "items,notes"), "public.notes", "'body'", "integer", "text")
    assert_nothing_created(pair, before)

    pair.dst("DROP TABLE notes")
    pair.dst("CREATE TABLE notes (id bigint PRIMARY KEY, body text)")
    pair.dst("INSERT INTO notes VALUES (1, 'already here')")
    failed(create(pair, "wf", "items,notes"), "public.notes", "already has rows", "TRUNCATE")
    assert_nothing_created(pair, before)
    assert pair.dst("SELECT body FROM notes") == [("already here",)]


def test_source_rights_and_leftovers(pair):
    """What the first run does on the source (slot, publication, reads) is checked at create."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY)")
    # analyzed: else describing the table counts its rows, which a non-owner without SELECT may not
    # (that fails too, as "permission denied for table items", but without the way out)
    pair.src("ANALYZE items")
    before = target_tables(pair)
    plain = url(pair.source_server, pair.name, user=PLAIN)
    ident = sql.Identifier(PLAIN)

    failed(create(pair, "wf", "items", source=plain), PLAIN, f"ALTER ROLE {PLAIN} REPLICATION")
    pair.src(sql.SQL("ALTER ROLE {} REPLICATION").format(ident))
    failed(create(pair, "wf", "items", source=plain), PLAIN, f"GRANT CREATE ON DATABASE {pair.name}")
    pair.src(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(pair.name), ident))
    failed(create(pair, "wf", "items", source=plain), "public.items", f"OWNER TO {PLAIN}")
    assert_nothing_created(pair, before)
    pair.src(sql.SQL("ALTER TABLE items OWNER TO {}").format(ident))
    ok = create(pair, "ok", "items", source=plain)
    assert ok.returncode == 0, ok.stderr

    # a slot (or publication) of that name exists: another target's same-named workflow, or a leftover
    slot = object_name("sg", "wf")
    pair.src("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    failed(create(pair, "wf", "items"), slot, "pg_drop_replication_slot")
    pair.src("SELECT pg_drop_replication_slot(%s)", (slot,))
    pair.src(sql.SQL("CREATE PUBLICATION {} FOR TABLE items").format(sql.Identifier(slot)))
    failed(create(pair, "wf", "items"), slot, "DROP PUBLICATION")
    pair.src(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(slot)))
    assert pair.dst("SELECT name FROM sluicegate.workflows") == [("ok",)]


def test_source_without_logical_wal_level(pair, tmp_path):
    server = LocalPostgres(tmp_path / "replica", settings={"wal_level": "replica"}).init().start()
    try:
        _create_role(server)
        server.create_database("app")
        server.psql("CREATE TABLE items (id bigint PRIMARY KEY)", dbname="app")
        before = target_tables(pair)
        line = failed(create(pair, "wf", "items", source=url(server, "app")), "wal_level")
        assert "wal_level = logical" in line and "restart" in line, line
        assert_nothing_created(pair, before)
        assert server.psql("SELECT count(*) FROM pg_replication_slots", dbname="app") == "0"
    finally:
        server.stop()


def test_unreachable_or_refusing_databases(pair):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY)")
    before = target_tables(pair)
    src_port, dst_port = pair.source_server.port, pair.target_server.port

    port = dead_port()
    dead = url(pair.source_server, pair.name, port=port)
    wrong_src, wrong_dst, (dead_src, t_src), (dead_dst, t_dst) = parallel(
        lambda: create(pair, "wf", "items", source=url(pair.source_server, pair.name, WRONG)),
        lambda: create(pair, "wf", "items", target=url(pair.target_server, pair.name, WRONG)),
        lambda: timed(lambda: create(pair, "wf", "items", source=dead)),
        lambda: timed(lambda: create(pair, "wf", "items", target=dead)),
    )
    line = failed(wrong_src, "source", f"127.0.0.1:{src_port}", "password authentication failed",
                  "check the source user's password (pgpass file, PGPASSWORD or URL)")
    assert "target" not in line, line
    failed(wrong_dst, "target", f"127.0.0.1:{dst_port}", "password authentication failed",
           "check the target user's password (pgpass file, PGPASSWORD or URL)")
    # refused, not timed out (connect_timeout is 10 s), and not retried: generous for a loaded CI machine
    failed(dead_src, "source", f"127.0.0.1:{port}", "Connection refused")
    failed(dead_dst, "target", f"127.0.0.1:{port}", "Connection refused")
    assert max(t_src, t_dst) < 20, f"a refused connection must fail fast, took {max(t_src, t_dst):.1f} s"
    assert_nothing_created(pair, before)


def test_workflow_names(pair):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY)")
    target = url(pair.target_server, pair.name)

    # no workflow at all on this target yet (no sluicegate schema)
    status, run = parallel(lambda: sg("workflow", "status", "nosuch", target=target),
                           lambda: sg("workflow", "run", "nosuch", target=target, env=NO_JAVA))
    failed(status, "'nosuch'", "schema sluicegate is missing")
    failed(run, "'nosuch'", "schema sluicegate is missing")

    ok = create(pair, "wf", "items")
    assert ok.returncode == 0, ok.stderr
    assert "sluicegate workflow run wf" in ok.stdout
    state = workflow_state(pair)
    tables = target_tables(pair)

    failed(create(pair, "wf", "items"), "'wf'", "already exists", "sluicegate workflow delete wf")
    assert_nothing_created(pair, tables, state)

    env = {"SLUICEGATE_TARGET": target}
    status, run, close, stop, delete, usage1, usage2, by_env, missing_by_env = parallel(
        lambda: sg("workflow", "status", "nosuch", target=target),
        lambda: sg("workflow", "run", "nosuch", target=target, env=NO_JAVA),
        lambda: sg("workflow", "status", "w", target=target),
        lambda: sg("workflow", "stop", "nosuch", target=target),
        lambda: sg("workflow", "delete", "nosuch", target=target),
        # --target is required, unless SLUICEGATE_TARGET stands for it
        lambda: sg("workflow", "status", "wf"),
        lambda: sg("movetables", "create", "--workflow", "wf2", "--source", url(pair.source_server, pair.name)),
        lambda: sg("workflow", "status", "wf", "--json", env=env),
        lambda: sg("workflow", "status", "nosuch", env=env),
    )
    failed(status, "'nosuch'", "existing: wf")
    failed(run, "no workflow 'nosuch'")
    failed(close, "'w'", "did you mean 'wf'")
    failed(stop, "'nosuch'")
    failed(delete, "'nosuch'")
    for usage in (usage1, usage2):
        assert usage.returncode == 2 and "--target" in usage.stderr and "Traceback" not in usage.stderr
    assert by_env.returncode == 0, by_env.stderr
    doc = json.loads(by_env.stdout)
    assert doc["workflow"] == "wf"
    failed(missing_by_env, "'nosuch'")
    assert workflow_state(pair) == state
    assert target_tables(pair) == tables


def test_malformed_urls_never_echo_the_password(pair):
    target = url(pair.target_server, pair.name)
    bad = (f"postgresql://{ROLE}:{PASSWORD}@[::1/db",  # unparsable: libpq quotes the whole URI
           f"postgresql://{ROLE}:{PASSWORD}@127.0.0.1:notaport/db",
           f"postgresql://{ROLE}:{PASSWORD}@127.0.0.1:1/db?nosuchoption=1",
           f"host=127.0.0.1 port=1 user={ROLE} password='{PASSWORD} x' nosuchoption=1")
    for proc in parallel(*[lambda b=b: sg("movetables", "create", "--workflow", "wf", "--source", b,
                                          target=target) for b in bad]):
        failed(proc, "source")
    with psycopg.connect(pair.target) as c:
        assert c.execute("SELECT to_regclass('sluicegate.workflows')").fetchone()[0] is None
