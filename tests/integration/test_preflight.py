"""`sluicegate check`: the preflight proves what a run needs, as a role that has nothing but what it prints.

- every privileged call the code makes is one the check knows (scanned from the source against a real
  server's catalogs: a new call that needs a grant fails this test until postgres/needs.py has it);
- a bare role: each missing requirement is one line with the SQL that fixes it; a server without logical
  decoding: each setting one line;
- a role with exactly the grants `check` printed runs MoveTables with foreign keys through copy, replication,
  switch-traffic and complete, and an active-active Replicate both ways.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql

from sluicegate.localpg import LocalPostgres
from sluicegate.postgres import needs

from ..conftest import wait_for
from .helpers import assert_same, caught_up, reap_group, run_sql

SRC = Path(__file__).resolve().parents[2] / "src" / "sluicegate"
ROLE = f"sgcheck_{os.getpid()}"
PASSWORD = "Pw-" + secrets.token_hex(8)


def _sg(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SLUICEGATE_TARGET"}
    proc = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    assert PASSWORD not in proc.stdout + proc.stderr
    return proc


def _as_role(server: LocalPostgres, db: str, password: bool = True) -> str:
    pw = f":{quote(PASSWORD, safe='')}" if password else ""
    return f"postgresql://{ROLE}{pw}@127.0.0.1:{server.port}/{quote(db)}"


@pytest.fixture
def role(source_server, target_server, pgpass):
    """A login with no privileges on both servers (its password in the session's pgpass file: stored URLs carry
    none). Dropped with every grant it was given, after the test's databases (set up after it) are gone."""
    for server in (source_server, target_server):
        server.psql(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(ROLE), sql.Literal(PASSWORD)))
    before = pgpass.read_text()
    pgpass.write_text(before + f"127.0.0.1:*:*:{ROLE}:{PASSWORD}\n")
    yield ROLE
    pgpass.write_text(before)
    for server in (source_server, target_server):
        with psycopg.connect(server.url(), autocommit=True) as c:
            c.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(ROLE)))
            c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(ROLE)))


@pytest.fixture
def role_pair(role, pair):
    """The pair's databases, made after the role (so dropped before it)."""
    return pair


def _check(kind: str, *args: str) -> tuple[int, list[dict]]:
    out = _sg("check", kind, *args, "--json")
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)["problems"]


def _apply_fixes(problems: list[dict], servers: dict[int, LocalPostgres]) -> list[str]:
    """Run each problem's grant as a superuser on the database it names (not server settings: the session's
    servers are shared); the statements run."""
    done = []
    for p in problems:
        if not p["fix"] or p["area"] == "setting":
            continue
        port, db = re.search(r":(\d+)/(\S+)$", p["database"]).groups()
        with psycopg.connect(servers[int(port)].url(db), autocommit=True) as c:
            c.execute(p["fix"])
        done.append(p["fix"])
    return done


# --- the check knows every privileged call ------------------------------------------------------------------

def _calls() -> tuple[set[str], set[str]]:
    """(functions called as pg_…(…), parameters SET or set_config'd) anywhere in the package's source."""
    functions, params = set(), set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        functions |= set(re.findall(r"\b(pg_[a-z0-9_]+)\s*\(", text))
        params |= set(re.findall(r"\bSET\s+(?:LOCAL\s+|SESSION\s+)?([a-z_]+)\s*(?:=|TO\b)", text))
        params |= set(re.findall(r"set_config\(\s*'([a-z_.]+)'", text))
    return functions, params


@pytest.mark.parametrize("server", ["source_server", "source18_server"])
def test_every_privileged_call_is_known(server, request):
    functions, params = _calls()
    assert {"pg_replication_origin_create", "pg_create_logical_replication_slot"} <= functions  # the scan works
    assert {"session_replication_role", "deadlock_timeout", "lock_timeout"} <= params
    with psycopg.connect(request.getfixturevalue(server).url(), autocommit=True) as c:
        privileged_functions = {r[0] for r in c.execute(
            "SELECT DISTINCT proname FROM pg_proc WHERE proname = ANY(%s) "
            "AND NOT has_function_privilege('public', oid, 'EXECUTE')", (sorted(functions),))}
        privileged_params = {r[0] for r in c.execute(
            "SELECT name FROM pg_settings WHERE name = ANY(%s) AND context = 'superuser'", (sorted(params),))}
    assert privileged_functions, "the server grants every function the code calls to PUBLIC?"
    unknown = (privileged_functions - set(needs.names("function"))) | (privileged_params - set(needs.names("parameter")))
    assert not unknown, f"privileged calls postgres/needs.py does not know: {sorted(unknown)}"


# --- a bare role: one line per missing requirement ------------------------------------------------------------

FK_TABLES = """
CREATE TABLE parent (id int PRIMARY KEY, name text);
CREATE TABLE child (id bigserial PRIMARY KEY, parent_id int NOT NULL REFERENCES parent, note text);
CREATE TABLE bare (a int, b text);
"""


def test_check_names_each_missing_requirement(role_pair, source_server, target_server):
    p = role_pair
    p.src(FK_TABLES)
    src, dst = _as_role(source_server, p.name), _as_role(target_server, p.name)
    code, problems = _check("movetables", "--source", src, "--target", dst)
    lines = [(x["database"].split()[0], x["severity"], x["fix"] or x["action"]) for x in problems]
    print("\n".join(map(str, lines)))
    assert code == 1
    expected = {
        ("source", "error", f"ALTER ROLE {ROLE} REPLICATION"),
        ("source", "error", f"GRANT CREATE ON DATABASE {p.name} TO {ROLE}"),
        ("source", "error", f"ALTER TABLE public.parent OWNER TO {ROLE}"),
        ("source", "error", f"ALTER TABLE public.child OWNER TO {ROLE}"),
        ("target", "error", f"GRANT CREATE ON DATABASE {p.name} TO {ROLE}"),
        ("target", "error", f"ALTER ROLE {ROLE} REPLICATION"),  # read as a source after switch-traffic
        ("target", "warning", f"GRANT SET ON PARAMETER session_replication_role TO {ROLE}"),
    }
    assert expected <= set(lines), sorted(set(lines) - expected)
    keyless = [x for x in problems if "public.bare" in x["what"]]
    assert len(keyless) == 1 and "REPLICA IDENTITY FULL" in keyless[0]["what"]
    assert not any("pg_read_all_stats" in (x["fix"] or "") for x in problems)
    text = _sg("check", "movetables", "--source", src, "--target", dst)
    assert text.returncode == 1 and len(text.stdout.splitlines()) == len(problems)  # one line each
    # confirming only what the target's standbys flushed: their positions in pg_stat_replication
    code, problems = _check("movetables", "--source", src, "--target", dst, "--confirm-after-target-standbys")
    assert ("target", "error", f"GRANT pg_read_all_stats TO {ROLE}") in {
        (x["database"].split()[0], x["severity"], x["fix"]) for x in problems}
    assert not any("pg_read_all_stats" in (x["fix"] or "") for x in problems if x["database"].startswith("source"))
    # bidirectional: the origin functions and both parameters, on both clusters
    code, problems = _check("replicate", "--source", src, "--sink", dst, "--tables", "parent", "--bidirectional")
    for side in ("source", "sink"):
        fixes = {x["fix"] for x in problems if x["database"].startswith(side)}
        for fn in needs.names("function", {needs.BIDIRECTIONAL}):
            assert any(f.startswith(f"GRANT EXECUTE ON FUNCTION {fn}(") for f in fixes), (side, fn, fixes)
        for param in ("session_replication_role", "deadlock_timeout"):
            assert f"GRANT SET ON PARAMETER {param} TO {ROLE}" in fixes, (side, param)


def test_check_names_each_missing_setting(tmp_path):
    """A server without logical decoding or commit timestamps, and with no room for a slot."""
    server = LocalPostgres(tmp_path / "plain", settings={"wal_level": "replica", "max_replication_slots": 0,
                                                         "track_commit_timestamp": "off"}).init().start()
    try:
        server.create_database("db")
        server.psql("CREATE TABLE t (id int PRIMARY KEY)", dbname="db")
        url = server.url("db")
        code, problems = _check("replicate", "--source", url, "--sink", url.replace("/db", "/postgres"),
                                "--bidirectional")
        settings = {x["fix"] for x in problems if x["area"] == "setting"}
        assert code == 1
        assert {"ALTER SYSTEM SET wal_level = logical", "ALTER SYSTEM SET track_commit_timestamp = on",
                "ALTER SYSTEM SET max_replication_slots = 5"} <= settings, settings
        assert all(x["restart"] for x in problems if x["fix"] in settings and "keep_size" not in x["fix"])
    finally:
        server.stop()


# --- a role with exactly what check printed runs every step ---------------------------------------------------

def _driver(target: str, workflow: str, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("SLUICEGATE_TARGET", "SLUICEGATE_DRIVER_PID")}
    return subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", workflow, "--target",
                             target, "--no-progress"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.spark
def test_a_role_with_what_check_printed_runs_movetables_to_complete(role_pair, source_server, target_server,
                                                                       tmp_path):
    p = role_pair
    p.src(FK_TABLES.replace("CREATE TABLE bare (a int, b text);", ""))
    p.src("INSERT INTO parent SELECT g, 'p' || g FROM generate_series(1, 200) g")
    p.src("INSERT INTO child (parent_id, note) SELECT 1 + g % 200, 'c' FROM generate_series(1, 1000) g")
    servers = {source_server.port: source_server, target_server.port: target_server}
    src, dst = _as_role(source_server, p.name), _as_role(target_server, p.name)
    _, problems = _check("movetables", "--source", src, "--target", dst)
    granted = _apply_fixes(problems, servers)
    assert granted
    code, left = _check("movetables", "--source", src, "--target", dst)
    assert code == 0 and not [x for x in left if x["severity"] == "error"], left
    made = _sg("movetables", "create", "--workflow", "mt", "--source", src, "--target", dst)
    assert made.returncode == 0, made.stderr
    assert "not carried" not in made.stderr, made.stderr  # the foreign keys are carried: the role may apply them
    target = _as_role(target_server, p.name, password=False)
    log = tmp_path / "run.log"
    driver = _driver(target, "mt", log)
    try:
        p.src("INSERT INTO parent VALUES (201, 'late')")
        p.src("INSERT INTO child (parent_id, note) VALUES (201, 'late child')")
        wait_for(lambda: p.dst("SELECT count(*) FROM child WHERE note = 'late child'") == [(1,)], timeout=180,
                 what="copy and replication as the role", describe=lambda: log.read_text()[-2000:])
        wait_for(lambda: p.dst("SELECT convalidated FROM pg_constraint WHERE conrelid = 'child'::regclass "
                               "AND contype = 'f'") == [(True,)], timeout=60, what="the foreign key, validated")
        wait_for(lambda: caught_up(p, "mt") and p.dst("SELECT caught_up_at IS NOT NULL FROM sluicegate.streams")
                 == [(True,)], timeout=60, what="caught up", describe=lambda: log.read_text()[-2000:])
        switched = _sg("movetables", "switch-traffic", "mt", "--target", target, "--timeout", "60s")
        assert switched.returncode == 0, switched.stdout + switched.stderr + log.read_text()[-2000:]
        p.dst("INSERT INTO parent VALUES (202, 'on the target')")
        wait_for(lambda: p.src("SELECT count(*) FROM parent WHERE id = 202") == [(1,)], timeout=120,
                 what="the reverse stream, as the role", describe=lambda: log.read_text()[-2000:])
        done = _sg("movetables", "complete", "mt", "--target", target)
        assert done.returncode == 0, done.stdout + done.stderr
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
        assert assert_same(p, "parent", ["id"]) == 202 and assert_same(p, "child", ["id"]) == 1001
        assert "rror" not in log.read_text(), log.read_text()[-2000:]
    finally:
        reap_group(driver)


@pytest.mark.spark
def test_a_role_with_what_check_printed_runs_active_active(role_pair, source_server, target_server, tmp_path):
    p = role_pair
    table = "CREATE TABLE items (id int PRIMARY KEY, qty int NOT NULL)"
    p.src(table)
    p.dst(table)
    p.src("INSERT INTO items SELECT g, 0 FROM generate_series(1, 100) g")
    servers = {source_server.port: source_server, target_server.port: target_server}
    src, dst = _as_role(source_server, p.name), _as_role(target_server, p.name)
    p.dst(f'ALTER TABLE items OWNER TO "{ROLE}"')
    args = ("--source", src, "--sink", dst, "--tables", "items", "--bidirectional")
    _, problems = _check("replicate", *args)
    assert any("pg_replication_origin_xact_setup" in x["fix"] for x in problems)
    _apply_fixes(problems, servers)
    code, left = _check("replicate", *args)
    assert code == 0, left
    made = _sg("replicate", "create", "--workflow", "aa", *args)
    assert made.returncode == 0, made.stderr
    # until its copy from A is done, B refuses the application's writes (the copy would clear them from B only)
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction, match="being copied from"):
        p.dst("INSERT INTO items VALUES (500, 1)")
    logs = [tmp_path / "source.log", tmp_path / "sink.log"]
    drivers = [_driver(_as_role(s, p.name, password=False), "aa", log)
               for s, log in zip((source_server, target_server), logs)]
    try:
        # B takes writes once its copy from A is done (a copy replaces B's rows: README, Both ways)
        wait_for(lambda: p.dst("SELECT array_agg(DISTINCT state) FROM sluicegate.streams") == [(["Running"],)],
                 timeout=180, what="the sink's copy done", describe=lambda: logs[1].read_text()[-1500:] + "\n".join(
                     x for s in (source_server, target_server) for x in s.logfile.read_text().splitlines()[-400:]
                     if "denied" in x or "STATEMENT" in x))
        p.src("UPDATE items SET qty = 1 WHERE id <= 50")
        p.dst("INSERT INTO items VALUES (101, 7)")
        wait_for(lambda: p.dst("SELECT count(*) FROM items WHERE qty = 1") == [(50,)] and
                 p.src("SELECT qty FROM items WHERE id = 101") == [(7,)], timeout=180, what="both directions",
                 describe=lambda: "\n".join(x.read_text()[-1500:] for x in logs))
        assert assert_same(p, "items", ["id"]) == 101
        for log in logs:
            assert "rror" not in log.read_text(), log.read_text()[-2000:]
    finally:
        for d in drivers:
            reap_group(d)


@pytest.mark.spark
@pytest.mark.slow  # three drivers at once; the default set has MoveTables and active-active as the role
def test_a_role_with_what_check_printed_runs_materialize_replicate_and_delta(role_pair, source_server,
                                                                             target_server, tmp_path):
    """Three workflows from one source as the role, each checked, granted and run at once: a Materialize, a
    one-way Replicate (into a sink table the role does not own yet) and a MoveTables into Delta."""
    from .test_lake_movetables import delta_rows

    p = role_pair
    p.src("CREATE TABLE items (id int PRIMARY KEY, qty numeric NOT NULL, note text)")
    p.src("INSERT INTO items SELECT g, g, 'n' FROM generate_series(1, 300) g")
    p.dst("CREATE TABLE items (id int PRIMARY KEY, qty numeric NOT NULL, note text)")  # the postgres user's
    servers = {source_server.port: source_server, target_server.port: target_server}
    src, dst = _as_role(source_server, p.name), _as_role(target_server, p.name)
    lake = f"delta:{tmp_path / 'lake'}"
    rule = "items_even: SELECT id, qty FROM items WHERE id % 2 = 0"
    plans = {
        "mz": ("materialize", "--source", src, "--target", dst, "--rule", rule),
        "rp": ("replicate", "--source", src, "--sink", dst, "--tables", "items"),
        "dl": ("movetables", "--source", src, "--target", lake, "--tables", "items"),
    }
    found = {name: _check(kind, *args)[1] for name, (kind, *args) in plans.items()}  # the bare role, each plan
    assert any(f"ON public.items TO {ROLE}" in x["fix"] for x in found["rp"] if x["database"].startswith("sink"))
    assert not any("public.items TO" in x["fix"] for x in found["mz"] if x["database"].startswith("target"))
    assert not [x for x in found["dl"] if not x["database"].startswith("source")]  # Delta: the source only
    for problems in found.values():
        assert [x for x in problems if x["severity"] == "error"], problems
        _apply_fixes(problems, servers)
    for name, (kind, *args) in plans.items():
        code, left = _check(kind, *args)
        assert code == 0, (kind, left)
        made = _sg(kind, "create", "--workflow", name, *args)
        assert made.returncode == 0, (kind, made.stdout + made.stderr)
    target = _as_role(target_server, p.name, password=False)
    logs = {name: tmp_path / f"{name}.log" for name in plans}
    drivers = [_driver(lake if name == "dl" else target, name, log) for name, log in logs.items()]
    try:
        p.src("UPDATE items SET qty = -1 WHERE id = 2")
        p.src("INSERT INTO items VALUES (302, 5, 'late')")
        tail = lambda: "\n".join(f"{n}: {x.read_text()[-1200:]}" for n, x in logs.items())
        wait_for(lambda: p.dst("SELECT count(*), sum(qty) FROM items_even") ==
                 p.src("SELECT count(*), sum(qty) FROM items WHERE id % 2 = 0"), timeout=240,
                 what="the Materialize", describe=tail)
        wait_for(lambda: assert_same(p, "items", ["id"]) == 301, timeout=120, what="the Replicate", describe=tail)
        wait_for(lambda: sorted((r["id"], str(r["qty"])) for r in delta_rows(tmp_path / "lake", "public.items"))
                 == sorted((i, str(q)) for i, q in p.src("SELECT id, qty FROM items")), timeout=120,
                 what="the Delta MoveTables", describe=tail)
        for name, log in logs.items():
            assert "rror" not in log.read_text(), (name, log.read_text()[-2000:])
    finally:
        for d in drivers:
            reap_group(d)


@pytest.mark.spark
@pytest.mark.slow  # five databases and a driver: the default set has MoveTables and active-active as the role
def test_a_role_with_what_check_printed_runs_a_reshard(role, source_server, target_server, tmp_path):
    from .helpers import RESHARD_SOURCES, assert_resharded, load_shard, reshard_caught_up, reshard_keyspace

    servers = {source_server.port: source_server, target_server.port: target_server}
    with reshard_keyspace(source_server, target_server) as ks:
        for shard in RESHARD_SOURCES:
            load_shard(ks["sources"][shard], shard, ids=2000)

        def as_role(url: str) -> str:
            port, db = re.search(r":(\d+)/([^/?]+)$", url).groups()
            return _as_role(servers[int(port)], db)

        args = [*(x for shard, url in ks["sources"].items() for x in ("--source-shard", f"{shard}={as_role(url)}")),
                *(x for shard, url in ks["targets"].items() for x in ("--target-shard", f"{shard}={as_role(url)}")),
                "--shard-key", "events=account_id"]  # events live with their account (helpers.load_shard)
        _, problems = _check("reshard", *args)
        assert {x["database"].split()[0] for x in problems if x["severity"] == "error"} == {"source", "target"}
        _apply_fixes(problems, servers)
        code, left = _check("reshard", *args)
        assert code == 0, left
        made = _sg("reshard", "create", "--workflow", "rs", *args)
        assert made.returncode == 0, made.stdout + made.stderr
        first = next(iter(ks["targets"].values()))
        port, db = re.search(r":(\d+)/([^/?]+)$", first).groups()
        log = tmp_path / "run.log"
        driver = _driver(_as_role(servers[int(port)], db, password=False), "rs", log)
        try:
            run_sql(ks["sources"]["-80"], "UPDATE accounts SET balance = balance + 1")
            wait_for(lambda: reshard_caught_up(ks), timeout=240, what="every stream caught up as the role",
                     describe=lambda: log.read_text()[-2000:])
            assert_resharded(ks)
            assert "rror" not in log.read_text(), log.read_text()[-2000:]
        finally:
            reap_group(driver)
