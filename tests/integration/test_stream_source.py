"""spark.readStream.format("sluicegate") on real PostgreSQL and real Spark: every change exactly once, batches
bounded by maxChangesPerBatch, the slot confirmed only behind Spark's commits, kill -9 and restart from the
checkpoint replaying the planned batch with the same rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from sluicegate.errors import TerminalError
from sluicegate.position import format_lsn, parse_lsn
from sluicegate.postgres.assembler import Change, TruncateChange, assemble
from sluicegate.postgres.pgoutput import UNCHANGED, Begin, Commit
from sluicegate.spark import stream_source

from ..conftest import wait_for
from .helpers import Writer, reap_group, slot_confirmed

pytestmark = pytest.mark.spark

DRIVER = Path(__file__).with_name("stream_source_driver.py")


def oracle_changes(pair, slot: str, publication: str) -> list[tuple]:
    """Every change a slot holds, peeked and decoded here without the data source's code:
    (commit end, lsn, table, op, before, after) with before/after as JSON text."""
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
            out += [(event.end_lsn, *row) for row in pending]
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


def committed_batches(checkpoint: Path) -> list[int]:
    d = checkpoint / "commits"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def test_changes_arrive_once_in_bounded_batches(pair, spark, tmp_path):
    pair.src("CREATE TABLE accounts (id int PRIMARY KEY, name text, note text, doc text)")
    pair.src("ALTER TABLE accounts ALTER COLUMN doc SET STORAGE EXTERNAL")  # big values stored out of line
    pair.src("CREATE TABLE events (id bigserial PRIMARY KEY, kind text NOT NULL)")
    pair.src("CREATE TABLE ignored (id int PRIMARY KEY)")  # not in `tables`: never streamed
    stream_source.register(spark)
    reader = (spark.readStream.format("sluicegate").option("source", pair.source).option("slot", "s1")
              .option("tables", "accounts, public.events").option("maxChangesPerBatch", "4"))

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
    pair.src("INSERT INTO events (kind) SELECT 'bulk' FROM generate_series(1, 7)")  # one transaction > limit
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
        query.awaitTermination(180)
        assert query.exception() is None
    finally:
        stop.set()
        sampler.join()
        query.stop()

    rows = [r.asDict() for r in spark.sql("SELECT * FROM sluicegate_changes").collect()]
    got = [as_change(r) for r in rows]
    assert len(got) == len(set(got)) == len(expected)  # exactly once
    assert sorted(got) == sorted(row[1:] for row in expected)
    by_lsn = {r["lsn"]: r for r in rows}
    assert all(r["commit_lsn"] == format_lsn(end) for end, r in ((e[0], by_lsn[e[1]]) for e in expected))

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

    # Admission control: at most 4 changes per batch, unless one transaction alone is bigger.
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    for p in progress:
        start, end = ((json.loads(p["sources"][0][k]) or {"lsn": format_lsn(created)})["lsn"]
                      for k in ("startOffset", "endOffset"))
        start, end = parse_lsn(start), parse_lsn(end)
        batch = [r for r in rows if start < parse_lsn(r["commit_lsn"]) <= end]
        assert len(batch) == p["numInputRows"]
        assert len(batch) <= 4 or len({r["commit_lsn"] for r in batch}) == 1, p
    # 2+1 | 7 (the next transaction would pass the limit, so it gets a batch of its own) | 1+1+1+1 | 1+1+2 | 1
    assert [p["numInputRows"] for p in progress] == [3, 7, 4, 4, 1]

    # The slot only ever stood at its start or at the end of a batch Spark had committed.
    ends = {n: offsets(checkpoint, n)[1] for n in committed_batches(checkpoint)}
    assert len(samples) > 10
    for confirmed, done in samples:
        assert confirmed == created or confirmed in {ends[n] for n in done}, (format_lsn(confirmed), done)
    last = max(ends)
    assert slot_confirmed(pair, "s1") == ends[last - 1] < ends[last]  # the last batch waits for the next one


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
        args = [pair.source, "k9", str(checkpoint), str(out), "200", mode]
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
            final = max(end for end, *_ in oracle_changes(pair, "oracle", "k9"))
            wait_for(lambda: offsets(checkpoint, batches()[-1]["batch"])[1] >= final, timeout=120,
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
    assert sorted(by_batch[planned]) == sorted(row[1:] for row in expected if start < row[0] <= end)
    assert by_batch[planned]
    got = [row for rows in by_batch.values() for row in rows]
    assert len(got) == len(set(got))  # no duplicates
    assert sorted(got) == sorted(row[1:] for row in expected)  # none missing
    assert len(got) > 500


def test_reader_replays_a_batch_and_skips_earlier_ones(pair, monkeypatch):
    """The reader's calls one by one, as Spark makes them (no Spark needed): a batch read while the slot still
    stands before it skips the earlier batch; read again, it gives the same rows; a batch the slot has moved
    past is an error, never an empty batch."""
    pair.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.src("CREATE TABLE other (id int PRIMARY KEY)")
    reader = stream_source.ChangeSource({"source": pair.source, "slot": "r1", "tables": "t",
                                         "maxChangesPerBatch": "3"}).streamReader(stream_source.SCHEMA)
    limit = reader.getDefaultReadLimit()
    assert limit == ReadMaxRows(3)
    initial = reader.initialOffset()
    for i in range(10):
        pair.src("INSERT INTO t VALUES (%s, 'v')", (i,))

    def ids(start, end):
        [part] = reader.partitions(start, end)
        return [dict(r["after"])["id"] for batch in reader.read(part) for r in batch.to_pylist()]

    first = reader.latestOffset(initial, limit)
    second = reader.latestOffset(first, limit)
    assert parse_lsn(initial["lsn"]) < parse_lsn(first["lsn"]) < parse_lsn(second["lsn"])
    assert ids(first, second) == ["3", "4", "5"]  # the slot is still at the start of the first batch
    assert ids(first, second) == ["3", "4", "5"]
    assert ids(initial, first) == ["0", "1", "2"]
    reader.commit(first)
    assert slot_confirmed(pair, "r1") == parse_lsn(first["lsn"])
    assert ids(first, second) == ["3", "4", "5"]
    reader.commit(second)
    with pytest.raises(TerminalError, match=r"slot r1 was consumed up to .* past this query's offset"):
        ids(first, second)
    rest = reader.latestOffset(second, ReadAllAvailable())
    assert ids(second, rest) == ["6", "7", "8", "9"]
    assert reader.latestOffset(rest, limit) == rest  # nothing new

    # WAL that holds nothing to stream (other tables, other databases): once it passes 16 MB, an empty batch
    # carries the offset past it, so the slot can let it go.
    pair.src("INSERT INTO other SELECT generate_series(1, 1000)")
    assert reader.latestOffset(rest, limit) == rest
    pair.src("SELECT pg_logical_emit_message(false, 'padding', repeat('x', 17000000))")
    pair.src("INSERT INTO other VALUES (0)")  # its commit flushes the WAL before it
    idle = reader.latestOffset(rest, limit)
    assert parse_lsn(idle["lsn"]) - parse_lsn(rest["lsn"]) >= stream_source.IDLE_ADVANCE_BYTES
    assert ids(rest, idle) == []
    reader.commit(idle)
    assert slot_confirmed(pair, "r1") == parse_lsn(idle["lsn"])
    pair.src("UPDATE t SET v = 'after' WHERE id = 9")
    assert ids(idle, reader.latestOffset(idle, limit)) == ["9"]

    # A transaction bigger than the memory buffer waits on disk for its commit; wide rows: smaller batches.
    monkeypatch.setattr(stream_source, "TXN_BUFFER_BYTES", 2000)
    monkeypatch.setattr(stream_source, "ARROW_BATCH_BYTES", 5000)
    before_big = reader.latestOffset(idle, limit)
    pair.src("INSERT INTO t SELECT g, repeat('w', 100) FROM generate_series(100, 599) g")
    big = reader.latestOffset(before_big, limit)
    [part] = reader.partitions(before_big, big)
    batches = list(reader.read(part))
    rows = [r for batch in batches for r in batch.to_pylist()]
    assert [dict(r["after"])["id"] for r in rows] == [str(i) for i in range(100, 600)]
    assert {r["commit_lsn"] for r in rows} == {big["lsn"]} and len(batches) > 5
    reader.stop()


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
