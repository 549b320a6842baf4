"""spark.readStream.format("sluicegate") on real PostgreSQL and real Spark: every change exactly once, batches
[start, end) of the transactions whose commit record begins in them, bounded in WAL, planned on the driver
without a single peek and read once in an executor; the slot confirmed only behind Spark's commits; kill -9
and restart from the checkpoint replaying the planned batch with the same rows; executor errors reaching the
query with their type and SQLSTATE."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes, ReadMaxRows

from sluicegate.errors import RetryableError, TerminalError
from sluicegate.position import format_lsn, parse_lsn
from sluicegate.postgres import peek
from sluicegate.postgres.assembler import Change, TruncateChange, assemble
from sluicegate.postgres.pgoutput import UNCHANGED, Begin, Commit
from sluicegate.spark import stream_source

from ..conftest import wait_for
from .helpers import Writer, reap_group, slot_confirmed

pytestmark = pytest.mark.spark

DRIVER = Path(__file__).with_name("stream_source_driver.py")


def oracle_changes(pair, slot: str, publication: str) -> list[tuple]:
    """Every change a slot holds, peeked and decoded here without the data source's code:
    (commit record's start, its end, lsn, table, op, before, after) with before/after as JSON text."""
    rows = pair.src("SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                    "'proto_version', '1', 'publication_names', %s)", (slot, publication))
    out, pending = [], []
    for event in assemble((parse_lsn(lsn), bytes(data)) for lsn, data in rows):
        if isinstance(event, Begin):
            pending = []
        elif isinstance(event, Change):
            rel = event.relation
            names = [c.name for c in rel.columns]
            full_old = rel.replica_identity == "f"
            before = None if event.old is None else {
                n: v for n, v, c in zip(names, event.old, rel.columns) if full_old or c.flags & 1}
            after = None if event.new is None else {
                n: v for n, v in zip(names, event.new) if v is not UNCHANGED}
            op = {"I": "insert", "U": "update", "D": "delete"}[event.kind]
            table = f"{rel.schema}.{rel.name}"
            pending.append((format_lsn(event.lsn), table, op, canon(before), canon(after)))
        elif isinstance(event, TruncateChange):
            pending += [(format_lsn(event.lsn), f"{r.schema}.{r.name}", "truncate", None, None)
                        for r in event.relations]
        elif isinstance(event, Commit):
            out += [(event.commit_lsn, event.end_lsn, *row) for row in pending]
    return out


def canon(values: dict | None) -> str | None:
    return None if values is None else json.dumps(values, sort_keys=True)


def as_change(row: dict) -> tuple:
    table = f"{row['schema']}.{row['table']}"
    return (row["lsn"], table, row["op"], canon(row["before"]), canon(row["after"]))


def offsets(checkpoint: Path, batch: int) -> tuple[int, int] | None:
    """(start, end) of a planned batch, from Spark's offset log (start: the previous batch's end)."""
    def end(n):
        path = checkpoint / "offsets" / str(n)
        return parse_lsn(json.loads(path.read_text().splitlines()[2])["lsn"]) if path.exists() else None
    return (end(batch - 1), end(batch)) if end(batch) is not None else None


def planned_batches(checkpoint: Path) -> list[int]:
    return sorted(int(p.name) for p in (checkpoint / "offsets").iterdir() if p.name.isdigit())


def committed_batches(checkpoint: Path) -> list[int]:
    d = checkpoint / "commits"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def wal_insert_lsn(pair) -> int:
    return parse_lsn(pair.src("SELECT pg_current_wal_insert_lsn()::text")[0][0])


def test_changes_arrive_once_in_bounded_batches(pair, spark, tmp_path):
    pair.src("CREATE TABLE accounts (id int PRIMARY KEY, name text, note text, doc text)")
    pair.src("ALTER TABLE accounts ALTER COLUMN doc SET STORAGE EXTERNAL")  # big values stored out of line
    pair.src("CREATE TABLE events (id bigserial PRIMARY KEY, kind text NOT NULL)")
    pair.src("CREATE TABLE ignored (id int PRIMARY KEY)")  # not in `tables`: never streamed
    stream_source.register(spark)
    bound = 2048
    reader = (spark.readStream.format("sluicegate").option("source", pair.source).option("slot", "s1")
              .option("tables", "accounts, public.events").option("maxBytesPerBatch", "2KiB"))

    # The first query creates the publication and the slot (nothing to read yet); the second reads from there.
    first = reader.load().writeStream.format("noop").option("checkpointLocation", str(tmp_path / "c0")) \
        .trigger(availableNow=True).start()
    first.awaitTermination(120)
    assert first.exception() is None
    assert sorted(pair.src("SELECT tablename FROM pg_publication_tables WHERE pubname = 's1'")) == \
        [("accounts",), ("events",)]
    created = slot_confirmed(pair, "s1")

    doc = "d" * 5000
    pair.src("INSERT INTO accounts VALUES (1, 'ann', NULL, %s), (2, 'bob', 'x', 'small')", (doc,))
    pair.src("UPDATE accounts SET name = 'anna' WHERE id = 1")  # doc unchanged and TOASTed: not sent
    pair.src("INSERT INTO ignored VALUES (1)")
    pair.src("INSERT INTO events (kind) SELECT 'bulk' FROM generate_series(1, 7)")
    for i in range(6):
        pair.src("INSERT INTO events (kind) VALUES (%s)", (f"single {i}",))
    pair.src("BEGIN; DELETE FROM accounts WHERE id = 2; UPDATE accounts SET id = 3 WHERE id = 1; COMMIT")
    pair.src("BEGIN; INSERT INTO events (kind) VALUES ('rolled back'); ROLLBACK")
    pair.src("TRUNCATE events")
    expected = oracle_changes(pair, "s1", "s1")
    assert len(expected) == 19

    checkpoint = tmp_path / "c1"
    samples, stop = [], threading.Event()

    def sample():  # the slot's position, then which batches Spark had committed by then
        while not stop.is_set():
            confirmed = slot_confirmed(pair, "s1")
            samples.append((confirmed, committed_batches(checkpoint)))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    query = reader.load().writeStream.format("memory").queryName("sluicegate_changes") \
        .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    try:
        query.awaitTermination(300)
        assert query.exception() is None
    finally:
        stop.set()
        sampler.join()
        query.stop()

    rows = [r.asDict() for r in spark.sql("SELECT * FROM sluicegate_changes").collect()]
    got = [as_change(r) for r in rows]
    assert len(got) == len(set(got)) == len(expected)  # exactly once
    assert sorted(got) == sorted(row[2:] for row in expected)
    by_lsn = {r["lsn"]: r for r in rows}
    assert all(by_lsn[e[2]]["commit_lsn"] == format_lsn(e[1]) for e in expected)

    # op, key, before and after as the source wrote them
    accounts = sorted((r for r in rows if r["table"] == "accounts"), key=lambda r: parse_lsn(r["lsn"]))
    ins1, ins2, upd, dele, moved = accounts
    assert (ins1["op"], ins1["key"], ins1["before"]) == ("insert", ["id"], None)
    assert ins1["after"] == {"id": "1", "name": "ann", "note": None, "doc": doc}  # NULL stays null
    assert ins2["after"] == {"id": "2", "name": "bob", "note": "x", "doc": "small"}
    assert upd["op"] == "update" and upd["before"] is None
    assert upd["after"] == {"id": "1", "name": "anna", "note": None}  # unchanged TOAST value left out
    assert dele["op"] == "delete" and dele["before"] == {"id": "2"} and dele["after"] is None
    assert moved["op"] == "update" and moved["before"] == {"id": "1"} and moved["after"]["id"] == "3"
    assert dele["xid"] == moved["xid"] and dele["commit_lsn"] == moved["commit_lsn"]
    truncates = [r for r in rows if r["op"] == "truncate"]
    assert [(r["table"], r["key"], r["before"], r["after"]) for r in truncates] == \
        [("events", ["id"], None, None)]
    assert not [r for r in rows if r["table"] == "ignored"]
    assert not [r for r in rows if r["after"] and r["after"].get("kind") == "rolled back"]
    assert all(r["commit_time"] is not None and r["xid"] > 0 for r in rows)

    # Admission control: a batch spans at most 2 KiB of WAL and holds exactly the transactions whose commit
    # record begins in it, whole (the first one too, though its WAL alone, with the TOASTed doc, is more).
    final_of = {e[2]: e[0] for e in expected}
    batches = planned_batches(checkpoint)
    spans = [offsets(checkpoint, n) for n in batches]
    spans[0] = (created, spans[0][1])
    assert all(0 < end - start <= bound for start, end in spans)
    progress = {p["batchId"]: p["numInputRows"] for p in query.recentProgress}
    assert sorted(progress) == batches
    for n, (start, end) in zip(batches, spans):
        assert progress[n] == sum(1 for r in rows if start <= final_of[r["lsn"]] < end), n
    assert sum(1 for n in batches if progress[n]) >= 3

    # The slot only ever stood at its start or at the end of a batch Spark had committed.
    ends = {n: offsets(checkpoint, n)[1] for n in committed_batches(checkpoint)}
    assert len(samples) > 10
    for confirmed, done in samples:
        assert confirmed == created or confirmed in {ends[n] for n in done}, (format_lsn(confirmed), done)
    last = max(ends)
    assert slot_confirmed(pair, "s1") == ends[last - 1] < ends[last]  # the last batch waits for the next one


def test_driver_plans_without_decoding(pair, spark, tmp_path):
    """The source's statement log shows who ran what: the driver's connection never peeks at the slot, and
    each batch is peeked exactly once, by an executor, up to the batch's end."""
    pair.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.src("CREATE PUBLICATION p1 FOR TABLE t")
    pair.src("SELECT pg_create_logical_replication_slot('p1', 'pgoutput')")
    pair.src(sql.SQL("ALTER DATABASE {} SET log_statement = 'all'").format(sql.Identifier(pair.name)))
    log = pair.source_server.logfile
    since = log.stat().st_size
    for i in range(40):
        pair.src("INSERT INTO t VALUES (%s, repeat('v', 100))", (i,))
    stream_source.register(spark)
    reader = (spark.readStream.format("sluicegate").option("source", pair.source).option("slot", "p1")
              .option("maxBytesPerBatch", "2KiB"))
    checkpoint = tmp_path / "c"
    query = reader.load().writeStream.format("memory").queryName("planned_only") \
        .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    query.awaitTermination(300)
    assert query.exception() is None
    ids = sorted(int(r["after"]["id"]) for r in spark.sql("SELECT after FROM planned_only").collect())
    assert ids == list(range(40))

    roles, statements, peeks = {}, {}, []
    line_re = re.compile(r"^\S+ \S+ \S+ \[(\d+)\] (LOG|DETAIL):  (.*)$")
    last_peek = {}
    with log.open(errors="replace") as f:
        f.seek(since)
        for line in f:
            found = line_re.match(line)
            if not found:
                continue
            pid, kind, text = int(found[1]), found[2], found[3]
            if kind == "LOG":
                for role in (stream_source.PLANNER, stream_source.READER):
                    if text.endswith(f"SET application_name = '{role}'"):
                        roles[pid] = role
                statements.setdefault(pid, []).append(text)
                if "pg_logical_slot_peek" in text or "pg_logical_slot_get" in text:
                    last_peek[pid] = len(peeks)
                    peeks.append([pid, None])
            elif pid in last_peek and peeks[last_peek[pid]][1] is None:  # the peek's parameters
                upto = re.search(r"\$2 = '([0-9A-F]+/[0-9A-F]+)'", text)
                peeks[last_peek.pop(pid)][1] = parse_lsn(upto[1]) if upto else None
    planners = [pid for pid, role in roles.items() if role == stream_source.PLANNER]
    assert planners
    planner_statements = [s for pid in planners for s in statements[pid]]
    assert any("pg_current_wal_flush_lsn" in s for s in planner_statements)  # the log shows the planner...
    assert any("pg_replication_slot_advance" in s for s in planner_statements)
    assert not [pid for pid, _ in peeks if pid in planners]  # ... and it never peeked
    assert {roles.get(pid) for pid, _ in peeks} == {stream_source.READER}
    ends = []
    for n in planned_batches(checkpoint):
        start, end = offsets(checkpoint, n)
        if start is None or end > start:
            ends.append(end)
    assert len(ends) >= 3
    assert sorted(upto for _, upto in peeks) == sorted(ends)  # one peek per batch, up to its end


# Slow (26 s): a fault test; CI's sample of kill -9 tests is MoveTables', Replicate's and the Delta target's.
@pytest.mark.slow
def test_kill_9_replays_the_planned_batch(pair, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("CREATE TABLE tags (id int PRIMARY KEY, label text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 300) g")
    pair.src("CREATE PUBLICATION k9 FOR TABLE items, tags")
    pair.src("SELECT pg_create_logical_replication_slot('k9', 'pgoutput')")
    pair.src("SELECT pg_create_logical_replication_slot('oracle', 'pgoutput')")  # sees the same changes
    with psycopg.connect(pair.source) as c:
        for i in range(40):  # two tables per transaction
            c.execute("INSERT INTO tags VALUES (%s, NULL)", (i,))
            c.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (i + 1,))
            c.commit()
    writer = Writer(pair.source, 300, pause=0.02)
    writer.start()
    checkpoint, out, log = tmp_path / "checkpoint", tmp_path / "batches.jsonl", tmp_path / "driver.log"
    env = {**os.environ, "STREAM_FAULT_PAUSE": "stream_source.read", "STREAM_FAULT_DIR": str(tmp_path)}
    env.pop("SLUICEGATE_DRIVER_PID", None)

    def start(mode):
        args = [pair.source, "k9", str(checkpoint), str(out), "48KiB", mode]
        return subprocess.Popen([sys.executable, str(DRIVER), *args], env=env, stdout=log.open("ab"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def batches():
        return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []

    def tail():
        return log.read_text()[-3000:]

    try:
        driver = start("first")
        try:
            paused = tmp_path / "stream_source.read"
            wait_for(lambda: paused.exists() or driver.poll() is not None, timeout=240,
                     what="the pause in read()", describe=tail)
            assert driver.poll() is None, tail()
            written = batches()
            planned = max(int(p.name) for p in (checkpoint / "offsets").iterdir() if p.name.isdigit())
            assert [b["batch"] for b in written] == list(range(planned)) and planned >= 2  # batches 0..k done
            assert committed_batches(checkpoint)[-1] == planned - 1
            os.kill(driver.pid, signal.SIGKILL)
        finally:
            reap_group(driver)
        replayed = offsets(checkpoint, planned)
        assert slot_confirmed(pair, "k9") <= replayed[0]  # never past what Spark committed

        driver = start("resume")
        try:
            wait_for(lambda: len(batches()) > planned + 3, timeout=240, what="batches after the restart",
                     describe=tail)
            writer.stop_event.set()
            writer.join()
            assert writer.error is None and writer.commits > 50
            final = max(begins for begins, *_ in oracle_changes(pair, "oracle", "k9"))
            wait_for(lambda: offsets(checkpoint, batches()[-1]["batch"])[1] > final, timeout=120,
                     what="the stream caught up", describe=tail)
        finally:
            reap_group(driver)
    finally:
        writer.stop_event.set()
        writer.join()

    expected = oracle_changes(pair, "oracle", "k9")
    by_batch = {}
    for b in batches():  # a batch written twice (replayed after its write) must hold the same rows
        rows = [as_change(r) for r in b["rows"]]
        assert by_batch.setdefault(b["batch"], rows) == rows
    start, end = replayed
    assert sorted(by_batch[planned]) == sorted(row[2:] for row in expected if start <= row[0] < end)
    assert by_batch[planned]
    got = [row for rows in by_batch.values() for row in rows]
    assert len(got) == len(set(got))  # no duplicates
    assert sorted(got) == sorted(row[2:] for row in expected)  # none missing
    assert len(got) > 500


def test_reader_batches_by_commit_start(pair, monkeypatch):
    """The reader's calls one by one, as Spark makes them (no Spark needed). A batch [start, end) holds the
    transactions whose commit record begins in it, for any positions: between records, inside a commit
    record, or at commit ends (the offsets of older checkpoints); a batch read while the slot still stands
    before it skips the earlier batch; read again, it gives the same rows; a batch the slot has moved past is
    an error, never an empty batch."""
    pair.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.src("CREATE TABLE other (id int PRIMARY KEY)")
    reader = stream_source.ChangeSource({"source": pair.source, "slot": "r1", "tables": "t",
                                         "maxChangesPerBatch": "3"}).streamReader(stream_source.SCHEMA)
    limit = reader.getDefaultReadLimit()
    assert limit == ReadMaxBytes(3 * stream_source.BYTES_PER_CHANGE)
    initial = reader.initialOffset()
    marks = []  # marks[i]: the WAL insert position before transaction i; its commit record begins after it
    for i in range(10):
        marks.append(wal_insert_lsn(pair))
        pair.src("INSERT INTO t VALUES (%s, 'v')", (i,))
    marks.append(wal_insert_lsn(pair))
    commits = sorted({(begins, ends) for begins, ends, *_ in oracle_changes(pair, "r1", "r1")})
    assert len(commits) == 10 and all(marks[i] < commits[i][0] < marks[i + 1] for i in range(10))

    def at(lsn):
        return {"lsn": format_lsn(lsn)}

    def ids(start, end):
        [part] = reader.partitions(at(start), at(end))
        return [dict(r["after"])["id"] for batch in reader.read(part) for r in batch.to_pylist()]

    # Planning: positions only, at most the read limit's WAL past the start.
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    start = parse_lsn(initial["lsn"])
    assert reader.latestOffset(initial, limit) == at(start + 3 * stream_source.BYTES_PER_CHANGE)
    assert reader.latestOffset(initial, ReadMaxRows(2)) == at(start + 2 * stream_source.BYTES_PER_CHANGE)
    assert reader.latestOffset(initial, ReadMaxBytes(1 << 30)) == at(flushed)
    assert reader.latestOffset(initial, ReadAllAvailable()) == at(flushed)
    assert reader.partitions(initial, initial) == []

    assert ids(marks[3], marks[6]) == ["3", "4", "5"]  # the slot is still at the start of the first batch
    assert ids(marks[3], marks[6]) == ["3", "4", "5"]
    assert ids(start, marks[3]) == ["0", "1", "2"]
    reader.commit(at(marks[3]))
    assert slot_confirmed(pair, "r1") == marks[3]
    assert ids(marks[3], marks[6]) == ["3", "4", "5"]

    # Commit ends (older checkpoints' offsets): (end 7, end 9] by commit end = [end 7, end 9) by commit start.
    assert ids(commits[6][1], commits[7][1]) == ["7"]
    assert ids(commits[7][1], commits[9][1]) == ["8", "9"]

    # An offset inside transaction 6's commit record: the transaction belongs to the batch its record
    # begins in, and a slot confirmed there skips it.
    inside = commits[6][0] + 1
    assert commits[6][1] > inside
    assert ids(marks[6], commits[6][0]) == []
    assert ids(marks[6], inside) == ["6"]
    reader.commit(at(marks[6]))
    reader.commit(at(inside))
    assert slot_confirmed(pair, "r1") == inside
    assert ids(inside, marks[10]) == ["7", "8", "9"]
    with pytest.raises(TerminalError, match=r"slot r1 was consumed up to .* past this query's offset"):
        ids(marks[6], inside)
    with pytest.raises(TerminalError, match=r"slot r1 was consumed up to .* past this query's offset"):
        reader.latestOffset(at(marks[6]), limit)  # found on the driver too
    # A slot confirmed exactly where a commit record begins still has that transaction.
    reader.commit(at(commits[7][0]))
    assert slot_confirmed(pair, "r1") == commits[7][0]
    assert ids(commits[7][0], marks[10]) == ["7", "8", "9"]

    # Nothing written: the offset stays (our own peeks and slot advances write no WAL); WAL that holds nothing
    # to stream (other tables, other databases) makes an empty batch, which lets the slot release it.
    rest = marks[10]

    def settled():
        nonlocal rest
        latest = parse_lsn(reader.latestOffset(at(rest), ReadAllAvailable())["lsn"])
        reader.commit(at(latest))
        if latest == rest:
            return True
        rest = latest
        return False

    wait_for(settled, timeout=60, what="the offset to stay where it is")
    pair.src("INSERT INTO other SELECT generate_series(1, 1000)")
    idle = reader.latestOffset(at(rest), ReadAllAvailable())
    assert parse_lsn(idle["lsn"]) > rest
    assert ids(rest, parse_lsn(idle["lsn"])) == []
    reader.commit(idle)
    assert slot_confirmed(pair, "r1") == parse_lsn(idle["lsn"])
    pair.src("UPDATE t SET v = 'after' WHERE id = 9")
    after = reader.latestOffset(idle, ReadAllAvailable())
    assert ids(parse_lsn(idle["lsn"]), parse_lsn(after["lsn"])) == ["9"]

    # Trigger.AvailableNow: nothing flushed after its start is planned.
    later = stream_source.ChangeSource({"source": pair.source, "slot": "r1", "tables": "t"}) \
        .streamReader(stream_source.SCHEMA)
    later.prepareForTriggerAvailableNow()
    ceiling = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    pair.src("INSERT INTO t VALUES (10, 'late')")
    assert parse_lsn(later.latestOffset(idle, ReadAllAvailable())["lsn"]) <= ceiling
    later.stop()

    # A transaction bigger than the memory buffer waits on disk for its commit; wide rows: smaller batches.
    monkeypatch.setattr(stream_source, "TXN_BUFFER_BYTES", 2000)
    monkeypatch.setattr(stream_source, "ARROW_BATCH_BYTES", 5000)
    before_big = wal_insert_lsn(pair)
    pair.src("INSERT INTO t SELECT g, repeat('w', 100) FROM generate_series(100, 599) g")
    big = parse_lsn(reader.latestOffset(at(before_big), ReadAllAvailable())["lsn"])
    [part] = reader.partitions(at(before_big), at(big))
    batches = list(reader.read(part))
    rows = [r for batch in batches for r in batch.to_pylist()]
    assert [dict(r["after"])["id"] for r in rows] == [str(i) for i in range(100, 600)]
    assert len({r["commit_lsn"] for r in rows}) == 1 and len(batches) > 5
    reader.stop()


def test_read_errors_keep_type_and_sqlstate(pair, monkeypatch):
    """read() in an executor: a lost connection is retried in place and the batch still comes whole and once;
    a terminal error (here the publication dropped under a planned batch) is ours, carries the server's
    SQLSTATE, and is raised at once, not retried."""
    pair.src("CREATE TABLE t (id int PRIMARY KEY)")
    reader = stream_source.ChangeSource({"source": pair.source, "slot": "e1", "tables": "t"}) \
        .streamReader(stream_source.SCHEMA)
    start = reader.initialOffset()
    for i in range(10):
        pair.src("INSERT INTO t SELECT g FROM generate_series(%s::int, %s::int) g",
                 (i * 100, i * 100 + 99))
    end = reader.latestOffset(start, ReadAllAvailable())
    [part] = reader.partitions(start, end)

    monkeypatch.setattr(stream_source, "ROWS_PER_ARROW_BATCH", 100)
    monkeypatch.setattr(peek, "FETCH_ROWS", 50)  # (the peek's cursor: rows a round trip)
    batches = reader.read(part)
    got = [r["after"] for r in next(batches).to_pylist()]  # a transaction handed over, 9 still on the server
    terminated = pair.src("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE application_name = %s", (stream_source.READER,))
    assert terminated == [(True,)]
    got += [r["after"] for batch in batches for r in batch.to_pylist()]
    assert [int(dict(a)["id"]) for a in got] == list(range(1000))  # resumed after the rows Spark had

    pair.src("DROP PUBLICATION e1")  # decoding looks it up as of each change: changes after the drop fail
    pair.src("INSERT INTO t VALUES (1000)")
    [part] = reader.partitions(end, reader.latestOffset(end, ReadAllAvailable()))
    t = time.monotonic()
    with pytest.raises(TerminalError, match=r"reading changes \[.*\) of slot e1 failed: publication "
                                            r"\"e1\" does not exist.* \(SQLSTATE 42704\)$") as failed:
        list(reader.read(part))
    assert time.monotonic() - t < stream_source.RETRY_SECONDS / 2  # raised at once, not retried
    assert "\n" not in str(failed.value) and not failed.value.retryable
    reader.stop()


def test_executor_errors_reach_the_query(pair, spark, tmp_path):
    """Spark carries read()'s exception to the query as the text of a Python traceback: our type, our
    message, the SQLSTATE; query_error() gives the error back; a terminal error ends the query."""
    pair.src("CREATE TABLE t (id int PRIMARY KEY)")
    pair.src("CREATE PUBLICATION q1 FOR TABLE t")
    pair.src("SELECT pg_create_logical_replication_slot('q1', 'pgoutput')")
    pair.src("INSERT INTO t VALUES (1)")
    stream_source.register(spark)
    reader = spark.readStream.format("sluicegate").option("source", pair.source).option("slot", "q1")
    checkpoint = tmp_path / "c"
    first = reader.load().writeStream.format("noop").option("checkpointLocation", str(checkpoint)) \
        .trigger(availableNow=True).start()
    first.awaitTermination(120)
    assert first.exception() is None and planned_batches(checkpoint)  # the next query resumes after it
    pair.src("DROP PUBLICATION q1")  # the same checkpoint: the query does not create it again
    pair.src("INSERT INTO t VALUES (2)")  # decoded as of the drop: the publication is missing
    query = reader.load().writeStream.format("noop").option("checkpointLocation", str(checkpoint)) \
        .trigger(availableNow=True).start()
    with pytest.raises(Exception, match=r"sluicegate\.errors\.TerminalError: reading changes .* of slot q1 "
                                        r"failed: publication \"q1\" does not exist.*\(SQLSTATE 42704\)"):
        query.awaitTermination(120)
    err = stream_source.query_error(query.exception())
    assert type(err) is TerminalError and not err.retryable
    assert err.message.startswith("reading changes [") and err.message.endswith("(SQLSTATE 42704)")
    assert stream_source.query_error(RuntimeError("something else")) is None
    assert isinstance(stream_source.query_error(RuntimeError(
        "Traceback ...\nsluicegate.errors.RetryableError: source restarting")), RetryableError)


def test_bad_options_and_sources(pair, spark, tmp_path):
    stream_source.register(spark)

    def load(**options):
        reader = spark.readStream.format("sluicegate")
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load()

    with pytest.raises(Exception, match=r"unknown option 'maxchangesperbtach'.*did you mean 'maxChangesPer"):
        load(source=pair.source, slot="s", maxChangesPerBtach="10")
    with pytest.raises(Exception, match=r"needs option 'slot'"):
        load(source=pair.source)
    with pytest.raises(Exception, match=r"'maxChangesPerBatch' must be a positive whole number"):
        load(source=pair.source, slot="s", maxChangesPerBatch="0")
    with pytest.raises(Exception, match=r"'maxBytesPerBatch' must be a positive size .* not 'lots'"):
        load(source=pair.source, slot="s", maxBytesPerBatch="lots")
    with pytest.raises(Exception, match=r"cannot connect to source 127\.0\.0\.1:1/x") as failed:
        load(source="postgresql://u:secret@127.0.0.1:1/x", slot="s")
    assert "secret" not in str(failed.value)

    # An unknown table, found when the query starts: the slot is not created.
    pair.src("CREATE TABLE orders (id int PRIMARY KEY)")
    query = load(source=pair.source, slot="s2", tables="ordrs").writeStream.format("noop") \
        .option("checkpointLocation", str(tmp_path / "c")).trigger(availableNow=True).start()
    with pytest.raises(Exception, match=r"unknown source table 'ordrs': did you mean 'orders'"):
        query.awaitTermination(120)
    assert not pair.src("SELECT 1 FROM pg_replication_slots WHERE slot_name = 's2'")
