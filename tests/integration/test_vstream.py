"""VStream end to end on real PostgreSQL and a real gRPC server: Transaction messages from a position,
segmentation on the wire, streaming of open transactions (ROLLBACK, ROLLBACK_STATEMENT), resume after
kill -9 of the CLI client, reconnect after kill -9 of the server, backpressure, heartbeats."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from sluicegate.changes import model as m
from sluicegate.errors import TerminalError, UsageError
from sluicegate.position import format_lsn, parse_lsn
from sluicegate.vstream import VStreamServer, client

from ..conftest import wait_for

SLOT = "sg_vstream_{}"
LISTENING = re.compile(r"on (127\.0\.0\.1:\d+)")


# -- helpers ------------------------------------------------------------------------------------------

class Collector(threading.Thread):
    """Reads a VStream client's events into a list, as fast as they come."""

    def __init__(self, target: str, client_id: str, **options):
        super().__init__(daemon=True)
        self.stream = client.stream(target, client_id, **options)
        self.events: list = []
        self.error: BaseException | None = None

    def run(self):
        try:
            for ev in self.stream:
                self.events.append(ev)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def transactions(self) -> list[m.Transaction]:
        return [e for e in list(self.events) if isinstance(e, m.Transaction)]

    def heartbeats(self) -> list:
        return [e for e in list(self.events) if not isinstance(e, m.Transaction)]

    def finished(self, xid: int) -> bool:
        return any(t.context.transaction_id == xid and t.end_segment for t in self.transactions())

    def __enter__(self):
        self.start()
        wait_for(lambda: self.events or self.error, timeout=60, what="the stream's first event")
        assert self.error is None, self.error
        return self

    def __exit__(self, *exc):
        self.stream.cancel()
        self.join(timeout=30)
        assert not self.is_alive()


def complete(messages) -> list[tuple[int, list]]:
    """Drizzle reader semantics: (transaction id, its messages) per transaction whose end_segment was seen, in
    that order; a transaction's earlier partial run is dropped when segment 1 comes again; a rolled-back one
    (ROLLBACK statement) is dropped."""
    open_: dict[int, list] = {}
    out = []
    for t in messages:
        xid = t.context.transaction_id
        if t.segment_id == 1:
            open_[xid] = []
        open_.setdefault(xid, []).append(t)
        if t.end_segment:
            msgs = open_.pop(xid)
            assert [x.segment_id for x in msgs] == list(range(1, len(msgs) + 1)), f"gap in transaction {xid}"
            if not any(st.type == m.ROLLBACK for x in msgs for st in x.statements):
                out.append((xid, msgs))
    return out


def row_changes(msgs) -> list[tuple[str, str, str]]:
    """(type, table, key) per row change of one transaction, ROLLBACK_STATEMENT applied (a rolled-back
    subtransaction's rows are dropped)."""
    statements = [st for x in msgs for st in x.statements]
    undone = {st.subtransaction_id for st in statements if st.type == m.ROLLBACK_STATEMENT}
    out = []
    for st in statements:
        if st.subtransaction_id in undone or st.type == m.ROLLBACK_STATEMENT:
            continue
        if st.type == m.TRUNCATE:
            out.extend(("TRUNCATE", f"{t.schema}.{t.name}", "") for t in st.truncated)
            continue
        names = [c.name for c in st.table.columns]
        for r in st.rows:
            rec = r.after if r.HasField("after") else r.before
            out.append((m.type_name(st.type), f"{st.table.schema}.{st.table.name}",
                        dict(zip(names, m.values(rec)))["id"]))
    return out


def flushed(pair) -> int:
    return parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])


def inserted(pair) -> int:
    """The end of the WAL written so far, flushed or not: a ROLLBACK's abort record is not flushed when it is
    written (the WAL writer flushes it within wal_writer_delay), and a walsender sends only flushed WAL."""
    return parse_lsn(pair.src("SELECT pg_current_wal_insert_lsn()::text")[0][0])


def confirmed(pair, client_id: str) -> int:
    rows = pair.src("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                    (SLOT.format(client_id),))
    return parse_lsn(rows[0][0])


def slot_active(pair, client_id: str) -> bool:
    rows = pair.src("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (SLOT.format(client_id),))
    return rows[0][0]


def xid_of(conn) -> int:
    return conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]


def cli_args(*args) -> list[str]:
    return [sys.executable, "-m", "sluicegate.cli.main", *args]


class ServerProcess:
    """`sluicegate vstream serve` as a subprocess (its address from its first stderr line); stopped by PID."""

    def __init__(self, source: str, log: Path, *options: str, port: int = 0):
        self.log = log
        seen = len(LISTENING.findall(log.read_text())) if log.exists() else 0
        self.proc = subprocess.Popen(
            cli_args("vstream", "serve", "--source", source, "--port", str(port),
                     "--heartbeat-seconds", "0.2", *options),
            stdout=subprocess.DEVNULL, stderr=log.open("ab"), start_new_session=True)
        found = wait_for(lambda: self.proc.poll() is None and LISTENING.findall(log.read_text())[seen:],
                         timeout=60, what="the server listening", describe=lambda: log.read_text()[-2000:])
        self.address = found[-1]

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(timeout=60) == 0, self.log.read_text()[-2000:]


@pytest.fixture
def server(pair):
    with VStreamServer(pair.source, heartbeat_seconds=0.2, decoding_work_mem="64kB") as srv:
        yield srv


# -- transactions from a position ----------------------------------------------------------------------

def test_transactions_from_a_position(pair, server, tmp_path):
    pair.src("CREATE TABLE a (id int PRIMARY KEY, v text)")
    pair.src("CREATE TABLE b (id int PRIMARY KEY, v text, n numeric, j jsonb, bin bytea)")
    with Collector(server.address, "c1") as reader:  # the first request made the slot and publication
        with psycopg.connect(pair.source) as c:
            x1 = xid_of(c)
            c.execute("INSERT INTO a VALUES (1, 'one'), (2, 'two'), (3, NULL)")
            c.execute("INSERT INTO b VALUES (1, 'it''s', 1.50, '{\"k\": [1]}', '\\x00ff')")
            c.commit()
            x2 = xid_of(c)
            c.execute("UPDATE a SET v = 'uno' WHERE id = 1")
            c.execute("UPDATE a SET id = 20 WHERE id = 2")  # the key changes: before carries the old key
            c.execute("DELETE FROM a WHERE id = 3")
            c.commit()
            xr = xid_of(c)
            c.execute("INSERT INTO a VALUES (99, 'rolled back')")
            c.rollback()
            x3 = xid_of(c)
            c.execute("TRUNCATE b")
            c.commit()
        wait_for(lambda: reader.finished(x3), timeout=60, what="the third transaction")
        got = complete(reader.transactions())
    # The client went away: the server stops reading the source (its walsender ends).
    wait_for(lambda: not slot_active(pair, "c1"), timeout=30, what="the idle stream's walsender gone")
    assert [x for x, _ in got] == [x1, x2, x3]  # the rolled-back transaction never appears
    assert all(t.context.transaction_id != xr for t in reader.transactions())
    j1, j2, j3 = (m.to_json(msgs[0]) for _, msgs in got)
    assert [(s["type"], s["table"]) for s in j1["statements"]] == [("INSERT", "public.a"),
                                                                   ("INSERT", "public.b")]
    assert [r["after"] for r in j1["statements"][0]["rows"]] == [
        {"id": "1", "v": "one"}, {"id": "2", "v": "two"}, {"id": "3", "v": None}]
    assert j1["statements"][1]["rows"] == [{"before": None, "after": {
        "id": "1", "v": "it's", "n": "1.50", "j": '{"k": [1]}', "bin": "\\x00ff"}}]
    assert [(s["type"], s["rows"]) for s in j2["statements"]] == [
        ("UPDATE", [{"before": None, "after": {"id": "1", "v": "uno"}},
                    {"before": {"id": "2", "v": None}, "after": {"id": "20", "v": "two"}}]),
        ("DELETE", [{"before": {"id": "3", "v": None}, "after": None}])]
    assert j3["statements"][0]["type"] == "TRUNCATE" and j3["statements"][0]["tables"] == ["public.b"]
    assert all(j["end_segment"] and j["segment_id"] == 1 and j["source_id"] for j in (j1, j2, j3))
    p1, p2, p3 = (msgs[-1].context.position for _, msgs in got)
    assert p1 < p2 < p3
    assert confirmed(pair, "c1") < p1  # reading moved nothing: only a client's acknowledgement confirms

    # Resume from the end of the first transaction: the slot is confirmed there, the rest comes again.
    with Collector(server.address, "c1", position=p1) as again:
        wait_for(lambda: again.finished(x3), timeout=60, what="the third transaction again")
    assert [x for x, _ in complete(again.transactions())] == [x2, x3]
    assert confirmed(pair, "c1") == p1
    # Position 0: where the slot stands (p1).
    with Collector(server.address, "c1") as from_slot:
        wait_for(lambda: from_slot.finished(x3), timeout=60, what="the third transaction from the slot")
    assert [x for x, _ in complete(from_slot.transactions())] == [x2, x3]

    # A position before the slot's: the changes between are gone; refused with the way out.
    with pytest.raises(TerminalError, match="gone.*re-bootstrap"):
        list(client.stream(server.address, "c1", position=p1 - 1))
    # The same through the CLI reading the source directly: one line, exit 1.
    out = subprocess.run(cli_args("vstream", "--source", pair.source, "--client-id", "c1", "--position",
                                  format_lsn(p1 - 1)),
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "re-bootstrap" in out.stderr, out.stderr
    assert "sluicegate@" not in out.stderr
    # A position past the source's WAL (another source's?) would skip changes: refused.
    with pytest.raises(UsageError, match="ahead of the source's WAL"):
        list(client.stream(server.address, "c1", position=flushed(pair) + 2**32))
    # The CLI from the slot's position, straight from the source: the summary lines.
    out = subprocess.run(cli_args("vstream", "--source", pair.source, "--client-id", "c1",
                                  "--max-messages", "2", "--no-heartbeats"),
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        (f"txn {x2} segment 1 end position {format_lsn(p2)}: UPDATE public.a (2 rows); "
         f"DELETE public.a (1 row)"),
        f"txn {x3} segment 1 end position {format_lsn(p3)}: TRUNCATE public.b"]
    # A table outside the client's publication is refused, naming the way to add it.
    pair.src("CREATE TABLE c (id int PRIMARY KEY)")
    with pytest.raises(UsageError, match=r"public\.c is not in .*ALTER PUBLICATION sg_vstream_c1 ADD TABLE "):
        list(client.stream(server.address, "c1", tables=["c"]))


def test_python_client_acknowledges(pair, server):
    """stream(...).ack() through a server and reading the source directly; Ack on the wire with no stream."""
    import grpc

    from sluicegate.changes import change_pb2 as pb
    from sluicegate.changes import change_pb2_grpc as pb_grpc

    pair.src("CREATE TABLE a (id int PRIMARY KEY)")
    xids = []
    with Collector(server.address, "api"), psycopg.connect(pair.source, autocommit=True) as c:
        for i in range(4):  # the Collector made the slot and publication
            with c.transaction():
                xids.append(xid_of(c))
                c.execute("INSERT INTO a VALUES (%s)", (i,))

    def until(events, xid) -> dict[int, int]:
        """Read on (one iteration of `events` throughout: ending it closes the stream) up to `xid`."""
        got = {}
        for ev in events.iterator:
            if isinstance(ev, m.Transaction) and ev.end_segment:
                got[ev.context.transaction_id] = ev.context.position
                if ev.context.transaction_id == xid:
                    return got
        raise AssertionError("the stream ended")

    events = client.stream(server.address, "api")
    events.iterator = iter(events)
    ends = until(events, xids[1])
    assert list(ends) == xids[:2]
    with pytest.raises(UsageError, match="handed out only up to"):
        events.ack(ends[xids[1]] + 1)
    events.ack(ends[xids[0]])  # the first is handled; the second is not (yet)
    events.close()
    assert events.acked == ends[xids[0]]
    wait_for(lambda: confirmed(pair, "api") == ends[xids[0]], timeout=10, what="the slot at the first",
             describe=lambda: (format_lsn(confirmed(pair, "api")), {x: format_lsn(p) for x, p in ends.items()}))
    # Reading the source directly, from where the slot stands: the second transaction comes again.
    direct = client.stream(pair.source, "api")
    direct.iterator = iter(direct)
    ends = until(direct, xids[2])
    assert list(ends) == xids[1:3]
    direct.ack()  # everything handed out
    direct.close()
    wait_for(lambda: confirmed(pair, "api") == ends[xids[2]], timeout=10, what="the slot at the third")
    # Ack on the wire (any gRPC client), no stream open: confirmed with SQL; the answer says where it stands.
    again = client.stream(server.address, "api")
    again.iterator = iter(again)
    fourth = until(again, xids[3])[xids[3]]
    again.close()
    wait_for(lambda: not slot_active(pair, "api"), timeout=30, what="the stream's walsender gone")
    with grpc.insecure_channel(server.address) as channel:
        ack = pb_grpc.VStreamStub(channel).Ack
        assert ack(pb.VStreamRequest(client_id="api", position=fourth), timeout=30).position == fourth
        assert confirmed(pair, "api") == fourth
        with pytest.raises(grpc.RpcError) as bad:
            ack(pb.VStreamRequest(client_id="api", position=flushed(pair) + 2**32), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ahead of" in bad.value.details()


def test_takeover_by_the_same_client_id(pair, server):
    pair.src("CREATE TABLE a (id int PRIMARY KEY)")
    with Collector(server.address, "same") as first, Collector(server.address, "same") as second:
        wait_for(lambda: first.error is not None, timeout=30, what="the first stream ended")
        assert isinstance(first.error, TerminalError) and "taken over" in str(first.error)
        pair.src("INSERT INTO a VALUES (1)")
        wait_for(lambda: second.transactions(), timeout=30, what="the new stream goes on")


# -- segmentation -------------------------------------------------------------------------------------

def test_segments_on_the_wire(pair, server):
    pair.src("CREATE TABLE a (id int PRIMARY KEY, v text)")
    pair.src("CREATE TABLE b (id int PRIMARY KEY, v text)")
    pair.src("INSERT INTO b SELECT g, 'b' FROM generate_series(1, 100) g")
    # Each statement alone is bigger than the threshold: every one is cut into segments.
    threshold = 4096
    with Collector(server.address, "seg", threshold=threshold, streaming=False) as reader:  # whole at commit
        with psycopg.connect(pair.source) as c:
            x1 = xid_of(c)
            c.execute("INSERT INTO a SELECT g, repeat('a', 40) FROM generate_series(1, 800) g")
            c.execute("UPDATE b SET v = repeat('c', 60)")
            c.execute("DELETE FROM a")
            c.commit()
            x2 = xid_of(c)
            c.execute("INSERT INTO a SELECT g, 'row ' || g FROM generate_series(1001, 21000) g")
            c.commit()
        wait_for(lambda: reader.finished(x2), timeout=120, what="the 20k-row transaction")
    got = dict(complete(reader.transactions()))
    assert set(got) == {x1, x2}
    for xid, msgs in got.items():
        assert len(msgs) > 2
        assert all(t.context.transaction_id == xid for t in msgs)
        assert [t.segment_id for t in msgs] == list(range(1, len(msgs) + 1))
        assert [t.end_segment for t in msgs] == [False] * (len(msgs) - 1) + [True]
        assert all(threshold * 0.75 < t.ByteSize() <= threshold for t in msgs[:-1]), [
            t.ByteSize() for t in msgs]
    # Three statements, each segmented across messages, statement_id kept, end_segment on its last part.
    parts = [st for t in got[x1] for st in t.statements]
    assert sorted({st.statement_id for st in parts}) == [1, 2, 3]
    for sid, kind, rows in ((1, "INSERT", 800), (2, "UPDATE", 100), (3, "DELETE", 800)):
        mine = [st for st in parts if st.statement_id == sid]
        assert len(mine) > 1 and {m.type_name(st.type) for st in mine} == {kind}
        assert [st.segment_id for st in mine] == list(range(1, len(mine) + 1))
        assert [st.end_segment for st in mine] == [False] * (len(mine) - 1) + [True]
        assert sum(len(st.rows) for st in mine) == rows
    # One statement of 20k rows: one statement_id over every message, ids in order, none lost.
    big = [st for t in got[x2] for st in t.statements]
    assert {st.statement_id for st in big} == {1}
    assert [st.segment_id for st in big] == list(range(1, len(big) + 1)) and big[-1].end_segment
    assert [k for _, _, k in row_changes(got[x2])] == [str(i) for i in range(1001, 21001)]


# -- streaming of open transactions -------------------------------------------------------------------

def test_streamed_transactions(pair, server):
    pair.src("CREATE TABLE a (id int PRIMARY KEY, v text)")
    with Collector(server.address, "str", threshold=16384) as reader, psycopg.connect(pair.source) as c:
        def mine(xid):
            return [t for t in reader.transactions() if t.context.transaction_id == xid]

        # A big transaction arrives while it is still open on the source.
        x1 = xid_of(c)
        c.execute("INSERT INTO a SELECT g, repeat('x', 50) FROM generate_series(1, 5000) g")
        first = wait_for(lambda: mine(x1), timeout=60, what="a segment of the open transaction")
        still_open = "SELECT count(*) FROM pg_stat_activity WHERE backend_xid::text = %s"
        assert pair.src(still_open, (str(x1),))[0][0] == 1
        assert first[0].context.streamed and first[0].segment_id == 1 and not first[0].end_segment
        c.execute("INSERT INTO a VALUES (5001, 'last')")
        c.commit()
        wait_for(lambda: reader.finished(x1), timeout=60, what="its commit")
        assert [k for _, _, k in row_changes(mine(x1))] == [str(i) for i in range(1, 5002)]

        # Streamed, then rolled back: a ROLLBACK statement ends it.
        x2 = xid_of(c)
        c.execute("INSERT INTO a SELECT g, repeat('y', 50) FROM generate_series(10001, 15000) g")
        wait_for(lambda: mine(x2), timeout=60, what="a segment of the transaction to roll back")
        c.rollback()
        wait_for(lambda: reader.finished(x2), timeout=60, what="its ROLLBACK")
        last = mine(x2)[-1]
        assert [m.type_name(st.type) for st in last.statements] == ["ROLLBACK"]

        # ROLLBACK TO SAVEPOINT inside a big streamed transaction: ROLLBACK_STATEMENT names the
        # subtransaction, the rest commits.
        x3 = xid_of(c)
        c.execute("INSERT INTO a SELECT g, repeat('z', 50) FROM generate_series(20001, 23000) g")
        c.execute("SAVEPOINT s")
        c.execute("INSERT INTO a SELECT g, repeat('s', 50) FROM generate_series(30001, 36000) g")
        subs = wait_for(lambda: {st.subtransaction_id for t in mine(x3) for st in t.statements} - {x3},
                        timeout=60, what="a segment of the savepoint's rows")
        c.execute("ROLLBACK TO SAVEPOINT s")
        c.execute("INSERT INTO a VALUES (23001, 'after')")
        c.commit()
        wait_for(lambda: reader.finished(x3), timeout=60, what="the commit after the savepoint")
    msgs = mine(x3)
    undo = [st for t in msgs for st in t.statements if st.type == m.ROLLBACK_STATEMENT]
    assert len(undo) == 1 and {undo[0].subtransaction_id} == subs
    assert all(t.context.streamed for t in msgs) and msgs[-1].end_segment
    assert [k for _, _, k in row_changes(msgs)] == [str(i) for i in range(20001, 23002)]
    assert pair.src("SELECT count(*) FROM a")[0][0] == 5001 + 3001


# -- resume after kill -9 of the CLI client; two clients at once --------------------------------------

class TxnWriter(threading.Thread):
    """Transactions of inserts, updates and deletes (some big, some rolled back), recording what committed,
    in commit order."""

    def __init__(self, url: str, seed: int = 7):
        super().__init__(daemon=True)
        self.url, self.rng = url, random.Random(seed)
        self.committed: list[tuple[int, list]] = []
        self.rolled_back: list[int] = []
        self.stop_event = threading.Event()
        self.error = None

    def run(self):
        try:
            live, next_id = [], 1
            with psycopg.connect(self.url) as c:
                while not self.stop_event.is_set():
                    xid = xid_of(c)
                    n = 600 if self.rng.random() < 0.05 else self.rng.randint(1, 4)
                    ids = list(range(next_id, next_id + n))
                    c.execute("INSERT INTO items SELECT g, 0, repeat('p', 60) "
                              "FROM generate_series(%s::int, %s::int) g", (ids[0], ids[-1]))
                    ops = [("INSERT", i) for i in ids]
                    pool = [i for i in live if i not in ids]
                    upd = self.rng.sample(pool, min(len(pool), self.rng.randint(0, 3)))
                    if upd:
                        c.execute("UPDATE items SET qty = qty + 1 WHERE id = ANY(%s)", (upd,))
                        ops += [("UPDATE", i) for i in upd]
                    gone = self.rng.sample([i for i in pool if i not in upd], min(len(pool) - len(upd), 1))
                    if gone and self.rng.random() < 0.5:
                        c.execute("DELETE FROM items WHERE id = ANY(%s)", (gone,))
                        ops += [("DELETE", i) for i in gone]
                    else:
                        gone = []
                    next_id += n
                    if self.rng.random() < 0.07:
                        c.rollback()
                        self.rolled_back.append(xid)
                    else:
                        c.commit()
                        self.committed.append((xid, sorted((k, str(i)) for k, i in ops)))
                        live = [i for i in live + ids if i not in gone]
                    self.stop_event.wait(0.003)  # an application's pace, not a bulk load
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a process killed while writing it
            pass
    return out


def complete_json(lines: list[dict]) -> list[tuple[int, list]]:
    """complete() over --json lines: (xid, sorted (type, id) of its rows) per committed transaction."""
    open_: dict[int, list] = {}
    out = []
    for j in lines:
        if "heartbeat" in j:
            continue
        xid = j["transaction_id"]
        if j["segment_id"] == 1:
            open_[xid] = []
        open_.setdefault(xid, []).append(j)
        if j["end_segment"]:
            parts = open_.pop(xid)
            assert [p["segment_id"] for p in parts] == list(range(1, len(parts) + 1))
            if any(s["type"] == "ROLLBACK" for p in parts for s in p["statements"]):
                continue
            rows = sorted((s["type"], (r["after"] or r["before"])["id"])
                          for p in parts for s in p["statements"] for r in s["rows"])
            out.append((xid, rows))
    return out


def last_position(lines: list[dict]) -> str:
    """The last resume point printed: on a line that ends a transaction, or on a heartbeat."""
    return [j["heartbeat"]["position"] if "heartbeat" in j else j["position"]
            for j in lines if "heartbeat" in j or j["end_segment"]][-1]


def test_restart_with_the_same_client_id_resumes_after_its_acknowledgements(pair, server, tmp_path):
    """The CLI acknowledges what it wrote; its slot keeps that, so the same --client-id started again without
    --position resumes right after it: after SIGTERM with no transaction twice, after kill -9 with every
    transaction at least once, each whole, in order."""
    pair.src("CREATE TABLE items (id int PRIMARY KEY, qty int NOT NULL, pad text)")
    err = tmp_path / "c1.err"
    runs: list[Path] = []
    procs: list[subprocess.Popen] = []

    def start() -> Path:
        out = tmp_path / f"run{len(runs) + 1}.jsonl"
        procs.append(subprocess.Popen(cli_args("vstream", "--server", server.address, "--client-id", "c1",
                                               "--json"),
                                      stdout=out.open("wb"), stderr=err.open("ab"), start_new_session=True))
        runs.append(out)
        return out

    def read(out: Path, n: int, what: str) -> None:
        wait_for(lambda: len(complete_json(json_lines(out))) >= n, timeout=60, what=what,
                 describe=lambda: err.read_text()[-2000:])

    writer = TxnWriter(pair.source, seed=11)
    try:
        run1 = start()
        wait_for(lambda: any("heartbeat" in j for j in json_lines(run1)), timeout=60, what="the slot made")
        writer.start()
        read(run1, 30, "30 transactions in run 1")
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) == 0, err.read_text()
        assert "client c1 resumes there when started again" in err.read_text()
        # The slot stands where run 1's last acknowledgement put it: the last resume point it printed.
        stopped_at = parse_lsn(last_position(json_lines(run1)))
        wait_for(lambda: confirmed(pair, "c1") == stopped_at, timeout=10, what="the slot at run 1's position",
                 describe=lambda: f"slot {format_lsn(confirmed(pair, 'c1'))}, last printed {format_lsn(stopped_at)}")
        at_stop = len(writer.committed)
        wait_for(lambda: len(writer.committed) >= at_stop + 20, timeout=60, what="writes while stopped")

        run2 = start()  # the same client id, no --position
        read(run2, 30, "30 transactions in run 2")
        # It acknowledges as it goes (not only when it stops): the slot moves while it streams.
        thirtieth = [j for j in json_lines(run2) if "heartbeat" not in j and j["end_segment"]][29]["position"]
        wait_for(lambda: confirmed(pair, "c1") >= parse_lsn(thirtieth), timeout=10,
                 what="run 2's acknowledgements past its 30th transaction")
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait(timeout=30)
        wait_for(lambda: not slot_active(pair, "c1"), timeout=30, what="run 2's stream ended")
        killed_at = confirmed(pair, "c1")
        run3 = start()
        read(run3, 10, "transactions in run 3")
        writer.stop_event.set()
        writer.join(timeout=60)
        assert writer.error is None, writer.error
        last = writer.committed[-1][0]
        wait_for(lambda: last in [x for x, _ in complete_json(json_lines(run3))], timeout=60,
                 what="the writer's last transaction in run 3")
        procs[2].send_signal(signal.SIGTERM)
        assert procs[2].wait(timeout=30) == 0, err.read_text()
    finally:
        writer.stop_event.set()
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    got1, got2, got3 = (complete_json(json_lines(out)) for out in runs)
    committed = writer.committed
    # SIGTERM, then the same id again: every transaction exactly once, in commit order, each whole.
    assert got1 + got2 == committed[:len(got1) + len(got2)]
    assert len(got1) >= 30 and len(got2) >= 30
    # kill -9: run 3 starts at or before the first transaction run 2 did not finish (nothing missing), with
    # only whole transactions again (at least once), and goes on to the end.
    assert got3 == committed[len(committed) - len(got3):]
    repeated = len(got1) + len(got2) - committed.index(got3[0])
    # What comes again is exactly what run 2 printed after its last acknowledgement (never ahead of it).
    lines2 = json_lines(runs[1])
    assert stopped_at < killed_at <= parse_lsn(last_position(lines2))
    ends2 = {j["transaction_id"]: parse_lsn(j["position"]) for j in lines2 if "heartbeat" not in j and j["end_segment"]}
    assert repeated == sum(1 for x, _ in got2 if ends2[x] > killed_at)
    assert 0 <= repeated <= len(got2) - 30
    print(f"after kill -9: {repeated} of run 2's {len(got2)} transactions again")


def test_restart_reading_the_source_directly_resumes(pair):
    """The same without a server (--source): the acknowledgement goes to the slot through the replication
    connection, before the CLI lets go of it."""
    pair.src("CREATE TABLE a (id int PRIMARY KEY)")
    args = cli_args("vstream", "--source", pair.source, "--client-id", "direct", "--no-heartbeats",
                    "--max-messages", "2")
    with Collector(pair.source, "direct", heartbeat_seconds=0.2):  # makes the slot and publication
        pass
    xids = []
    with psycopg.connect(pair.source, autocommit=True) as c:
        for i in range(4):
            with c.transaction():
                xids.append(xid_of(c))
                c.execute("INSERT INTO a VALUES (%s)", (i,))
    seen = []
    for _ in range(2):
        out = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "client direct resumes there" in out.stderr, out.stderr
        seen += [int(line.split()[1]) for line in out.stdout.splitlines()]
    assert seen == xids


def test_resume_after_kill_9_of_the_cli_client(pair, tmp_path):
    pair.src("CREATE TABLE items (id int PRIMARY KEY, qty int NOT NULL, pad text)")
    srv = ServerProcess(pair.source, tmp_path / "server.log", "--threshold", "4KiB",
                        "--decoding-work-mem", "64kB")
    procs = []

    def client(client_id: str, out: Path, *options: str) -> subprocess.Popen:
        proc = subprocess.Popen(cli_args("vstream", "--server", srv.address, "--client-id", client_id,
                                         "--json", *options),
                                stdout=out.open("ab"), stderr=(tmp_path / f"{client_id}.err").open("ab"),
                                start_new_session=True)
        procs.append(proc)
        return proc

    def heartbeat_seen(out: Path) -> bool:
        return any("heartbeat" in j for j in json_lines(out))

    run1, run2, other = tmp_path / "run1.jsonl", tmp_path / "run2.jsonl", tmp_path / "other.jsonl"
    writer = TxnWriter(pair.source)
    try:
        first = client("resumer", run1)
        client("other", other)  # a second client id at the same time
        wait_for(lambda: heartbeat_seen(run1) and heartbeat_seen(other), timeout=60, what="both slots made")
        writer.start()
        wait_for(lambda: len(complete_json(json_lines(run1))) >= 40, timeout=120, what="40 transactions read")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        lines = json_lines(run1)
        restart = last_position(lines)  # its acknowledgements never pass what it printed
        third = client("resumer", run2, "--position", restart)
        wait_for(lambda: len(complete_json(json_lines(run2))) >= 40, timeout=120, what="40 more transactions")
        writer.stop_event.set()
        writer.join(timeout=60)
        assert writer.error is None, writer.error
        last = writer.committed[-1][0]
        for out in (run2, other):
            wait_for(lambda out=out: last in [x for x, _ in complete_json(json_lines(out))], timeout=120,
                     what=f"the last transaction in {out.name}")
        # Transactions rolled back after the last commit end later in the WAL: the clients have them all once a
        # heartbeat (never taken inside a transaction still being sent) passes the writer's end, its last abort
        # record included.
        end = inserted(pair)
        for out in (run2, other):
            wait_for(lambda out=out: any(parse_lsn(j["heartbeat"]["position"]) >= end
                                         for j in json_lines(out) if "heartbeat" in j),
                     timeout=120, what=f"{out.name} past the writer's end")
        third.send_signal(signal.SIGTERM)  # stops cleanly, saying where it resumes
        assert third.wait(timeout=30) == 0
        assert "client resumer resumes there" in (tmp_path / "resumer.err").read_text()
    finally:
        writer.stop_event.set()
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        srv.stop()
    both = complete_json(lines) + complete_json(json_lines(run2))
    assert [x for x, _ in both] == [x for x, _ in writer.committed]  # no gap, no duplicate, commit order
    assert both == writer.committed  # and every row of each
    assert complete_json(json_lines(other)) == writer.committed
    assert len(writer.rolled_back) > 0 and any(len(rows) > 100 for _, rows in writer.committed)
    # A rolled-back transaction appears only when it was streamed before its end, and then ends in ROLLBACK
    # (unless the kill cut run 1 short of its end). A streamed transaction is sent while it is in progress,
    # between transactions that commit meanwhile: the one the kill cut short need not be run 1's last.
    for name, out in (("run 1", lines), ("run 2", json_lines(run2)), ("other", json_lines(other))):
        for xid in set(writer.rolled_back) & {j.get("transaction_id") for j in out}:
            mine = [j for j in out if j.get("transaction_id") == xid]
            assert all(j["streamed"] for j in mine)
            ends = [[s["type"] for s in j["statements"]] for j in mine if j["end_segment"]]
            assert ends == [["ROLLBACK"]] or (out is lines and not ends), (name, mine[-1])


# -- reconnect after kill -9 of the server; backpressure; throughput ----------------------------------

def test_client_reconnects_after_the_server_is_killed(pair, tmp_path):
    pair.src("CREATE TABLE a (id int PRIMARY KEY, v text)")
    options = ("--threshold", "4KiB", "--decoding-work-mem", "64kB")
    srv = ServerProcess(pair.source, tmp_path / "server.log", *options)
    port = int(srv.address.rsplit(":", 1)[1])

    def transactions(events):
        return (ev for ev in events if isinstance(ev, m.Transaction))

    try:
        stream = client.stream(srv.address, "rc", max_backoff=1.0)
        events = iter(stream)
        next(events)  # the slot exists
        with psycopg.connect(pair.source) as c:
            # An open transaction streams; the server dies after two of its segments were read.
            x1 = xid_of(c)
            c.execute("INSERT INTO a SELECT g, 'r' || g FROM generate_series(1, 3000) g")
            txns = transactions(events)
            got = [next(txns), next(txns)]
            assert [(t.context.transaction_id, t.segment_id, t.end_segment) for t in got] == [(x1, 1, False),
                                                                                              (x1, 2, False)]
            srv.kill()
            srv = ServerProcess(pair.source, tmp_path / "server.log", *options, port=port)
            rest = []
            for t in txns:  # what the transport still held, then the made-up ROLLBACK
                rest.append(t)
                if t.end_segment:
                    break
            c.commit()
            for t in txns:  # the transaction again, whole
                rest.append(t)
                if t.end_segment:
                    break
        stream.cancel()
    finally:
        srv.stop()
    cut = next(i for i, t in enumerate(rest) if t.end_segment)
    before = got + rest[:cut]
    assert [t.segment_id for t in before] == list(range(1, len(before) + 1))
    assert rest[cut].context.transaction_id == x1 and rest[cut].segment_id == len(before) + 1
    assert [m.type_name(st.type) for st in rest[cut].statements] == ["ROLLBACK"]
    again = rest[cut + 1:]
    assert [t.segment_id for t in again] == list(range(1, len(again) + 1)) and again[-1].end_segment
    assert stream.reconnects >= 1
    assert [x for x, _ in complete(got + rest)] == [x1]
    assert [k for _, _, k in row_changes(again)] == [str(i) for i in range(1, 3001)]


def _rows(ev) -> int:
    return sum(len(st.rows) for st in ev.statements) if isinstance(ev, m.Transaction) else 0


def read_until(stream, end: int, timeout: float = 120) -> list[m.Transaction]:
    """The stream's transactions until it has sent all before WAL position `end`: a transaction ending there,
    or a heartbeat at or past it (WAL after the last commit, e.g. a running-transactions record or an
    autoanalyze, has no transaction of its own). Cancelled after `timeout` s, and the test fails."""
    timer = threading.Timer(timeout, stream.cancel)
    timer.start()
    got: list[m.Transaction] = []
    try:
        for ev in stream:
            if isinstance(ev, m.Transaction):
                got.append(ev)
                if ev.end_segment and ev.context.position >= end:
                    return got
            elif ev.position >= end:
                return got
    finally:
        timer.cancel()
    raise AssertionError(f"the stream ended (or took over {timeout:.0f}s) before {format_lsn(end)}: "
                         f"{len(got)} transaction messages")


def test_slow_client_backpressure_and_throughput(pair, tmp_path):
    pair.src("CREATE TABLE big (id int PRIMARY KEY, pad text)")
    srv = ServerProcess(pair.source, tmp_path / "server.log")
    figures = []
    try:
        stream = client.stream(srv.address, "slow")
        events = iter(stream)
        next(events)  # connected, slot made
        rss_before = srv.rss_kb()
        with psycopg.connect(pair.source, autocommit=True) as c:  # ~56 MB of changes in 20 transactions
            for i in range(20):
                c.execute("INSERT INTO big SELECT g, repeat('x', 250) "
                          "FROM generate_series(%s::int, %s::int) g", (i * 10_000 + 1, (i + 1) * 10_000))
        end = flushed(pair)
        txns = (ev for ev in events if isinstance(ev, m.Transaction))
        first = [next(txns) for _ in range(4)]
        # The client pauses: the server reads no further than the transport holds, its memory stays flat.
        def sent() -> int:
            rows = pair.src("""SELECT r.sent_lsn::text FROM pg_stat_replication r JOIN pg_replication_slots s
                               ON s.active_pid = r.pid WHERE s.slot_name = 'sg_vstream_slow'""")
            return parse_lsn(rows[0][0])

        # First the transport's buffers fill (on a slow machine, for seconds): until the position holds for
        # three polls in a row. One second of standstill was not enough: gRPC can still open its window
        # later (the sent position moved 3.7 MB during the sampling below, in a fresh-clone CI).
        polled: list = []

        def holds() -> bool:
            polled.append(sent())
            return len(polled) >= 3 and polled[-1] == polled[-2] == polled[-3]

        wait_for(holds, timeout=60, interval=1.0, what="the paused stream's walsender to stop sending")
        samples = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            samples.append((sent(), srv.rss_kb()))
            time.sleep(0.5)  # sampling a paused reader over time: there is no condition to wait for
        # The standstill above is the backpressure; the transport's buffers may still grow after it (TCP's
        # autotuning, gRPC's window: 3.7 MB moved during the sampling in two fresh-clone CI runs), so the
        # position is not required to stand still while sampling: only to stay far behind the WAL's end.
        behind = [end - s for s, _ in samples]
        assert min(behind) > 30 * 2**20, [format_lsn(s) for s, _ in samples]
        assert max(r for _, r in samples) < rss_before + 30 * 1024, (rss_before, samples)
        # The client goes away while the server waits to send: the server stops reading the source.
        stream.cancel()
        wait_for(lambda: not slot_active(pair, "slow"), timeout=30, what="the cancelled stream's walsender")
        # It comes back from its last complete position: the rest arrives, the cut transaction whole again.
        stream = client.stream(srv.address, "slow", position=stream.position)
        rest = read_until(stream, end)
        got = complete(first + rest)
        assert len(got) == 20 and sum(_rows(t) for _, msgs in got for t in msgs) == 200_000
        position = stream.position
        stream.cancel()

        # Throughput: a 200k-row burst already on the source, through the server to a client reading as fast
        # as it can (from its request to the last row), at two thresholds.
        for threshold in (1 << 20, 64 << 10):
            pair.src("TRUNCATE big")
            with psycopg.connect(pair.source, autocommit=True) as c:
                for i in range(20):
                    c.execute("INSERT INTO big SELECT g, 'row ' || g "
                              "FROM generate_series(%s::int, %s::int) g", (i * 10_000 + 1, (i + 1) * 10_000))
            end = flushed(pair)
            started = time.monotonic()
            stream = client.stream(srv.address, "slow", position=position, threshold=threshold)
            read = read_until(stream, end)
            seconds = time.monotonic() - started
            messages, burst_rows = len(read), sum(map(_rows, read))
            position = stream.position
            stream.cancel()
            assert burst_rows == 200_000
            figures.append(f"threshold {threshold >> 10} KiB: {messages} messages in {seconds:.2f}s, "
                           f"{messages / seconds:.0f} messages/s, {burst_rows / seconds:.0f} rows/s")
    finally:
        srv.stop()
    print(f"\nvstream 200k-row burst: {'; '.join(figures)}; paused reader: server "
          f"{min(behind) / 2**20:.0f} MiB behind the WAL end, RSS {rss_before // 1024} -> "
          f"{max(r for _, r in samples) // 1024} MiB")


# -- heartbeats ---------------------------------------------------------------------------------------

def test_heartbeats_move_past_unpublished_tables(pair, server):
    pair.src("CREATE TABLE a (id int PRIMARY KEY)")
    pair.src("CREATE TABLE noise (id serial PRIMARY KEY, pad text)")
    with Collector(server.address, "hb", tables=["a"]) as reader:
        wait_for(lambda: len(reader.heartbeats()) >= 3, timeout=30, what="heartbeats while idle")
        start = reader.heartbeats()[-1].position
        for _ in range(20):
            pair.src("INSERT INTO noise (pad) SELECT repeat('n', 100) FROM generate_series(1, 100)")
        target = flushed(pair)
        wait_for(lambda: reader.heartbeats()[-1].position >= target, timeout=60,
                 what="a heartbeat past the unpublished table's transactions")
        assert not reader.transactions()
        assert start < target
        # A heartbeat's position is a resume point: a new stream from it gets the next transaction only.
        pair.src("INSERT INTO a VALUES (1)")
        wait_for(lambda: reader.transactions(), timeout=30, what="the published table's transaction")
    first = next(i for i, e in enumerate(reader.events) if isinstance(e, m.Transaction))
    hb = reader.events[first - 1].position  # the last heartbeat before it
    with Collector(server.address, "hb", position=hb, tables=["a"]) as again:
        wait_for(lambda: again.transactions(), timeout=30, what="the transaction after the heartbeat")
        assert [t.context.transaction_id for t in again.transactions()] == [
            reader.transactions()[0].context.transaction_id]


def test_postgres_applier_killed_and_restarted_resumes_from_the_target(pair, tmp_path):
    """`vstream --source … --applier postgres:…` into a second database: kill -9 mid-stream, restart without
    --position (the applier's stored position is the resume point): the target equals the source, and the
    savepoint rollbacks and aborted streamed transactions of the writer left nothing behind."""
    ddl = "CREATE TABLE items (id int PRIMARY KEY, qty int NOT NULL, pad text)"
    pair.src(ddl)
    pair.dst(ddl)
    args = cli_args("vstream", "--source", pair.source, "--client-id", "feed", "--threshold", "4KiB",
                    "--decoding-work-mem", "64kB", "--applier", f"postgres:url={pair.target},name=feed")
    err = (tmp_path / "client.err").open("ab")
    procs = []

    def start() -> subprocess.Popen:
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
        return procs[-1]

    def applied() -> int:
        rows = pair.dst("SELECT position::text FROM sluicegate.applied_positions WHERE name = 'feed'")
        return parse_lsn(rows[0][0]) if rows else 0

    writer = TxnWriter(pair.source, seed=11)
    try:
        first = start()
        wait_for(lambda: confirmed(pair, "feed") or slot_active(pair, "feed"), timeout=60, what="the slot made")
        writer.start()
        wait_for(lambda: len(writer.committed) >= 60 and applied() > 0, timeout=120, what="some applied")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        at_kill = applied()
        # a savepoint rolled back inside a big one
        with psycopg.connect(pair.source, autocommit=True) as c, c.transaction():
            c.execute("INSERT INTO items SELECT g, 1, repeat('s', 80) FROM generate_series(900001, 903000) g")
            try:
                with c.transaction():
                    c.execute("INSERT INTO items SELECT g, 2, repeat('r', 80) "
                              "FROM generate_series(910001, 913000) g")
                    raise RuntimeError("roll back to the savepoint")
            except RuntimeError:
                pass
        second = start()  # no --position: from the target's stored one, which the slot is confirmed to
        wait_for(lambda: confirmed(pair, "feed") >= at_kill, timeout=60, what="the restart's request")
        wait_for(lambda: len(writer.committed) >= 150, timeout=120, what="more writes")
        writer.stop_event.set()
        writer.join(timeout=60)
        assert writer.error is None, writer.error
        wait_for(lambda: pair.dst("SELECT id, qty, pad FROM items ORDER BY id") ==
                 pair.src("SELECT id, qty, pad FROM items ORDER BY id"), timeout=120, what="target == source")
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    finally:
        writer.stop_event.set()
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    assert pair.dst("SELECT count(*) FROM items WHERE id BETWEEN 910001 AND 913000") == [(0,)]
    assert pair.dst("SELECT count(*) FROM items WHERE id BETWEEN 900001 AND 903000") == [(3000,)]
    assert len(writer.rolled_back) > 0
