"""Tests for the sans-IO pgoutput decoder, driven by bytes recorded from PostgreSQL 15 and 18.

Fixtures come from tests/fixtures/record_pgoutput.py (see its SCENARIO for the SQL behind every
message); each file's first line names the server it came from (recordings.py).  LSNs, xids, OIDs and commit times differ per recording, so tests derive those from the
stream itself; column values are deterministic and asserted exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import struct
import time
from datetime import datetime, timezone

import pytest

from sluicegate.postgres import pgoutput as po
from sluicegate.postgres.pgoutput import (
    UNCHANGED,
    Begin,
    Column,
    Commit,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    TypeMsg,
    Update,
    decode,
)

from . import recordings

BIG = "".join(f"{i:04d}" for i in range(750))  # same value as the recorder's TOASTed column


def load(name: str) -> list[tuple[int, int, object]]:
    return [(r["lsn"], r["xid"], decode(bytes.fromhex(r["data"]))) for r in recordings.read(name)[1]]


def raw(name: str) -> list[bytes]:
    return [bytes.fromhex(r["data"]) for r in recordings.read(name)[1]]


def every_raw() -> list[bytes]:
    return [data for name in recordings.NAMES for data in raw(name)]


@pytest.fixture(scope="module", params=recordings.MAJORS, ids=lambda major: f"pg{major}")
def major(request) -> int:
    """The server version whose recordings a test reads (text and binary of the same one)."""
    return request.param


@pytest.fixture(scope="module")
def text(major):
    return load(f"pg{major}_text")


@pytest.fixture(scope="module")
def binary(major):
    return load(f"pg{major}_binary")


def test_recordings_are_marked_with_their_server_version():
    assert recordings.MAJORS == [15, 18]
    for name in recordings.NAMES:
        header, rows = recordings.read(name)
        major = int(name.removeprefix("pg").split("_")[0])
        assert header["server_version_num"] // 10000 == major
        assert header["server_version"].startswith(f"{major}.")
        assert header["binary"] == name.endswith("_binary")
        assert rows and all(set(r) == {"lsn", "xid", "data"} for r in rows)


def msgs(rows):
    return [m for _, _, m in rows]


def rel(rows, name: str, nth: int = 0) -> Relation:
    return [m for m in msgs(rows) if isinstance(m, Relation) and m.name == name][nth]


def of(rows, cls):
    return [m for m in msgs(rows) if isinstance(m, cls)]


EXPECTED_SEQUENCE = (  # noqa: SIM905 - a transaction a line, each with its comment
    "B Y Y R I I C "  # T1 two inserts; Type msgs for enum + domain, then kitchen_sink Relation
    "B R I I C "  # T2 shop."Order Items"
    "B U C "  # T3 update leaving the TOASTed column alone
    "B U C "  # T4 primary-key change
    "B U C "  # T5 composite-key change
    "B D C "  # T6 delete
    "B M C "  # T7 transactional message
    "M "  # T8 non-transactional message: no Begin/Commit
    "B R I I U D C "  # T9 REPLICA IDENTITY FULL table
    "B R I C "  # T10 after ALTER TABLE: relation re-sent
    "B O I C "  # T11 replication origin
    "B Y Y R R T C"  # T13 TRUNCATE (relcache invalidated by it -> Type/Relation re-sent)
).split()
CODE = {Begin: "B", Commit: "C", Origin: "O", Relation: "R", TypeMsg: "Y", Insert: "I", Update: "U",
        Delete: "D", Truncate: "T", LogicalMessage: "M"}


# --- whole-stream properties ---------------------------------------------------------------------

@pytest.mark.parametrize("name", recordings.NAMES)
def test_message_sequence(name):
    assert [CODE[type(m)] for m in msgs(load(name))] == EXPECTED_SEQUENCE


@pytest.mark.parametrize("name", recordings.NAMES)
def test_transaction_framing(name):
    rows = load(name)
    begin = None
    txns = 0
    for lsn, xid, m in rows:
        if isinstance(m, Begin):
            assert begin is None
            begin = m
            assert xid == m.xid
            assert m.commit_time.tzinfo is timezone.utc
        elif isinstance(m, Commit):
            assert begin is not None
            assert m.flags == 0
            assert begin.final_lsn == m.commit_lsn
            assert m.end_lsn > m.commit_lsn
            assert m.commit_time == begin.commit_time
            assert lsn == m.end_lsn  # the SQL interface reports a commit at the end of its record
            begin = None
            txns += 1
        elif begin is None:
            assert isinstance(m, LogicalMessage) and m.flags == 0 and xid == 0
        else:
            assert xid == begin.xid
    assert begin is None and txns == 11
    commits = [m.commit_lsn for m in of(rows, Commit)]
    assert commits == sorted(commits)


def test_text_and_binary_agree_on_metadata(text, binary):
    for a, b in zip(msgs(text), msgs(binary)):
        if not isinstance(a, (Insert, Update, Delete)):
            assert a == b


# --- relations and types -------------------------------------------------------------------------

def test_kitchen_sink_relation(text):
    r = rel(text, "kitchen_sink")
    assert (r.schema, r.replica_identity) == ("public", "d")
    assert [c.name for c in r.columns] == [
        "id", "i", "n", "t", "b", "big", "flag", "ts", "arr", "tags", "doc", "m", "p", "nothing"]
    builtin = {"id": 20, "i": 23, "n": 1700, "t": 25, "b": 17, "big": 25, "flag": 16, "ts": 1184,
               "arr": 1007, "tags": 1009, "doc": 3802, "nothing": 25}
    assert {c.name: c.type_oid for c in r.columns if c.name in builtin} == builtin
    assert r.columns[0] == Column(1, "id", 20, -1)
    assert all(c.flags == 0 for c in r.columns[1:])
    assert r.key_columns == (0,)
    assert r.columns[2].typmod == ((12 << 16) | 3) + 4  # numeric(12,3), plus VARHDRSZ
    assert all(c.typmod == -1 for c in r.columns if c.name != "n")


def test_composite_key_quoted_relation(text):
    r = rel(text, "Order Items")
    assert (r.schema, r.name, r.replica_identity) == ("shop", "Order Items", "d")
    # The STORED generated column "doubled" is never replicated.
    assert [(c.flags, c.name, c.type_oid) for c in r.columns] == [
        (1, "order_id", 23), (1, "line_no", 23), (0, "Product Name", 25), (0, "qty", 23)]
    assert r.key_columns == (0, 1)


def test_full_identity_relation_and_ddl(text):
    before, after = rel(text, "audit_full", 0), rel(text, "audit_full", 1)
    assert before.oid == after.oid
    assert before.replica_identity == after.replica_identity == "f"
    assert [c.name for c in before.columns] == ["id", "note", "gone"]
    assert [c.name for c in after.columns] == ["id", "note", "extra"]  # dropped column vanishes
    assert before.key_columns == after.key_columns == (0, 1, 2)  # FULL: every column is "key"


def test_type_messages(text):
    r = rel(text, "kitchen_sink")
    oid = {c.name: c.type_oid for c in r.columns}
    enum_t, domain_t = of(text, TypeMsg)[:2]
    assert enum_t == TypeMsg(oid["m"], "public", "mood")
    # A domain is announced with its own OID but its *base* type's name; pg_catalog is sent as "".
    assert domain_t == TypeMsg(oid["p"], "pg_catalog", "int4")
    assert oid["m"] >= 16384 and oid["p"] >= 16384


# --- row changes (text mode) ---------------------------------------------------------------------

def test_inserts(text):
    ks, oi, af = (rel(text, n).oid for n in ("kitchen_sink", "Order Items", "audit_full"))
    inserts = of(text, Insert)
    assert inserts[0] == Insert(ks, (
        "1", "42", "12345.678", "Grüße, 世界 🚀", "\\x00ff10", BIG, "t", "2024-02-29 12:34:56.789+00",
        "{1,2,NULL}", '{"a b",c}', '{"k": [1, "ü"]}', "happy", "7", None))
    assert inserts[1] == Insert(ks, (
        "2", None, None, "", None, None, "f", None, "{}", None, "null", None, None, None))
    assert inserts[2] == Insert(oi, ("1", "1", "Widget", "3"))
    assert inserts[3] == Insert(oi, ("1", "2", 'Gadget "XL"', "1"))
    assert inserts[4:7] == [Insert(af, ("1", "first", "x")), Insert(af, ("2", None, "y")),
                            Insert(af, ("3", "after ddl", "99"))]
    assert inserts[7] == Insert(oi, ("2", "1", "from origin", "5"))
    assert len(inserts) == 8
    # The rolled-back INSERT never shows up.
    assert not any("rolled back" in v for m in inserts for v in m.new if isinstance(v, str))


def test_update_leaving_toast_unchanged(text):
    u = of(text, Update)[0]
    assert u.relation_oid == rel(text, "kitchen_sink").oid
    assert u.old is None and u.old_kind is None
    assert u.new[1] == "43"
    assert u.new[5] is UNCHANGED  # 'big' was not sent
    assert u.new[:5] == ("1", "43", "12345.678", "Grüße, 世界 🚀", "\\x00ff10")


def test_update_changing_key(text):
    u = of(text, Update)[1]
    assert u.old_kind == "K"
    assert u.old == ("2",) + (None,) * 13  # key columns only, the rest sent as NULL
    assert u.new == ("10", None, None, "", None, None, "f", None, "{}", None, "null", None, None, None)


def test_update_changing_composite_key_and_delete(text):
    oi = rel(text, "Order Items").oid
    assert of(text, Update)[2] == Update(oi, ("1", "2", None, None), "K", ("1", "3", 'Gadget "XL"', "1"))
    assert of(text, Delete)[0] == Delete(oi, ("1", "1", None, None), "K")


def test_replica_identity_full_old_tuples(text):
    af = rel(text, "audit_full").oid
    assert of(text, Update)[3] == Update(af, ("1", "first", "x"), "O", ("1", "changed", "x"))
    assert of(text, Delete)[1] == Delete(af, ("2", None, "y"), "O")


def test_logical_messages(text):
    tx, nontx = of(text, LogicalMessage)
    assert (tx.flags, tx.prefix, tx.content) == (1, "p", b"hello")
    assert (nontx.flags, nontx.prefix, nontx.content) == (0, "nt", b"\x01\x02")
    assert nontx.lsn > tx.lsn


def test_origin(text):
    seq = msgs(text)
    (origin,) = of(text, Origin)
    i = seq.index(origin)
    assert isinstance(seq[i - 1], Begin)  # Origin directly follows Begin
    assert origin == Origin(0xABCDEF, "upstream_a")
    # With a session origin, the commit timestamp is the one given to pg_replication_origin_xact_setup.
    assert seq[i - 1].commit_time == datetime(2024, 1, 1, tzinfo=timezone.utc)


def test_truncate(text):
    (t,) = of(text, Truncate)
    assert t.options == 3  # CASCADE | RESTART IDENTITY
    assert t.relation_oids == (rel(text, "kitchen_sink").oid, rel(text, "Order Items").oid)


# --- binary mode ('b' values) --------------------------------------------------------------------

def test_binary_values(binary):
    ins = of(binary, Insert)[0].new
    assert struct.unpack(">q", ins[0]) == (1,)
    assert struct.unpack(">i", ins[1]) == (42,)
    assert ins[3] == "Grüße, 世界 🚀".encode()
    assert ins[4] == b"\x00\xff\x10"  # bytea_send: the raw bytes
    assert ins[5] == BIG.encode()
    assert ins[6] == b"\x01"
    assert ins[10] == b'\x01{"k": [1, "\xc3\xbc"]}'  # jsonb_send: version byte + text
    assert ins[11] == b"happy"
    assert ins[13] is None
    assert all(isinstance(v, bytes) or v is None for v in ins)
    u = of(binary, Update)
    assert u[0].new[5] is UNCHANGED
    assert u[1].old_kind == "K" and u[1].old == (struct.pack(">q", 2),) + (None,) * 13


# --- synthetic messages --------------------------------------------------------------------------

def test_timestamps_and_begin_commit_layout():
    assert decode(b"B" + struct.pack(">QqI", 0x1_0000_0028, 0, 7)) == Begin(
        0x1_0000_0028, datetime(2000, 1, 1, tzinfo=timezone.utc), 7)
    c = decode(b"C" + struct.pack(">BQQq", 0, 100, 148, -1))
    assert c == Commit(0, 100, 148, datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc))


def test_stream_messages():
    ts = 86_400_000_000
    day2 = datetime(2000, 1, 2, tzinfo=timezone.utc)
    assert decode(b"S" + struct.pack(">IB", 900, 1)) == StreamStart(900, True)
    assert decode(b"S" + struct.pack(">IB", 900, 0)) == StreamStart(900, False)
    assert decode(b"E") == StreamStop()
    assert decode(b"c" + struct.pack(">IBQQq", 900, 0, 10, 20, ts)) == StreamCommit(900, 0, 10, 20, day2)
    assert decode(b"A" + struct.pack(">II", 900, 901)) == StreamAbort(900, 901)
    assert decode(b"A" + struct.pack(">IIQq", 900, 900, 5, ts)) == StreamAbort(900, 900)


def test_accepts_bytes_like():
    data = raw("pg15_text")[4]
    assert decode(bytearray(data)) == decode(memoryview(data)) == decode(data)


def test_value_types_and_tuple_kinds():
    body = (b"\x00\x05" + b"n" + b"u" + b"t\x00\x00\x00\x02hi"
            + b"b\x00\x00\x00\x03\x00\x01\x02" + b"t\x00\x00\x00\x00")
    m = decode(b"I" + struct.pack(">I", 5) + b"N" + body)
    assert m == Insert(5, (None, UNCHANGED, "hi", b"\x00\x01\x02", ""))
    assert type(m.new) is tuple


# --- malformed input -----------------------------------------------------------------------------

def test_empty_and_unknown_type():
    with pytest.raises(DecodeError, match="empty"):
        decode(b"")
    with pytest.raises(DecodeError, match="unknown pgoutput message type b'Z'"):
        decode(b"Z\x00\x00")
    with pytest.raises(ValueError):  # DecodeError is a ValueError
        decode(b"\xff")


def test_every_truncation_of_every_recorded_message_fails():
    seen = set()
    for data in every_raw():
        if data in seen:
            continue
        seen.add(data)
        for cut in range(len(data)):
            with pytest.raises(DecodeError):
                decode(data[:cut])


def test_trailing_bytes_fail():
    for data in set(raw("pg15_text")):
        with pytest.raises(DecodeError):
            decode(data + b"\x00")


def test_bad_markers():
    insert = b"I" + struct.pack(">I", 5) + b"N" + b"\x00\x01" + b"t\x00\x00\x00\x01x"
    decode(insert)
    with pytest.raises(DecodeError, match="value kind"):
        decode(insert.replace(b"t\x00", b"q\x00"))
    with pytest.raises(DecodeError, match="expected 'N'"):
        decode(b"I" + insert[1:5] + b"X" + insert[6:])
    with pytest.raises(DecodeError, match="'K', 'O' or 'N'"):
        decode(b"U" + insert[1:5] + b"X" + insert[6:])
    with pytest.raises(DecodeError, match="expected 'N' in pgoutput update"):
        decode(b"U" + insert[1:5] + b"K" + insert[6:] + b"K" + insert[6:])
    with pytest.raises(DecodeError, match="'K' or 'O'"):
        decode(b"D" + insert[1:5] + b"N" + insert[6:])
    with pytest.raises(DecodeError, match="non-UTF-8"):
        decode(b"I" + insert[1:5] + b"N\x00\x01t\x00\x00\x00\x01\xff")
    with pytest.raises(DecodeError, match="unterminated"):
        decode(b"O" + struct.pack(">Q", 1) + b"no-nul")


# --- value semantics -----------------------------------------------------------------------------

def test_unchanged_sentinel():
    assert repr(UNCHANGED) == "UNCHANGED"
    assert pickle.loads(pickle.dumps(UNCHANGED)) is UNCHANGED
    assert copy.deepcopy((UNCHANGED,))[0] is UNCHANGED
    m = pickle.loads(pickle.dumps(of(load("pg15_text"), Update)[0]))
    assert m.new[5] is po.UNCHANGED


def test_messages_are_frozen_slotted():
    b = Begin(1, datetime(2000, 1, 1, tzinfo=timezone.utc), 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.xid = 3  # type: ignore[misc]
    assert not hasattr(b, "__dict__")
    r = Relation(1, "s", "t", "d", (Column(0, "a", 23, -1), Column(1, "b", 23, -1), Column(1, "c", 25, -1)))
    assert r.key_columns == (1, 2)


def test_throughput_report():
    """Not a timing assertion: prints decode speed over the recorded mix (see with -s or -rP)."""
    data = [d for d in raw("pg15_text") if len(d) < 1000]  # skip the 3 KB TOAST insert
    rows = [d for d in data if d[:1] in b"IUD"]
    for label, sample in (("recorded mix", data), ("row changes", rows)):
        n = 0
        start = time.perf_counter()
        while time.perf_counter() - start < 0.3:
            for d in sample:
                decode(d)
            n += len(sample)
        rate = n / (time.perf_counter() - start)
        print(f"pgoutput decode, {label}: {rate:,.0f} messages/s")
        assert rate > 0


# --- the replay's hot path -----------------------------------------------------------------------

def test_decode_row_agrees_with_decode_on_every_recorded_row_change():
    rows = 0
    for data in every_raw():
        if data[0] not in po.ROW_CHANGES:
            continue
        msg = decode(data)
        kind, relid, old, new = po.decode_row(data)
        assert (kind, relid) == ({Insert: "I", Update: "U", Delete: "D"}[type(msg)], msg.relation_oid)
        assert (old, new) == (getattr(msg, "old", None), getattr(msg, "new", None))
        assert po.decode_row(bytearray(data)) == (kind, relid, old, new)
        rows += 1
    assert rows > 20


def test_decode_row_fails_like_decode():
    for data in set(every_raw()):
        if data[0] not in po.ROW_CHANGES:
            continue
        for cut in range(1, len(data)):
            with pytest.raises(DecodeError):
                po.decode_row(data[:cut])
        with pytest.raises(DecodeError):
            po.decode_row(data + b"\x00")
    insert = b"I" + struct.pack(">I", 5) + b"N" + b"\x00\x01" + b"t\x00\x00\x00\x01x"
    with pytest.raises(DecodeError, match="expected 'N'"):
        po.decode_row(b"I" + insert[1:5] + b"X" + insert[6:])
    with pytest.raises(DecodeError, match="'K', 'O' or 'N'"):
        po.decode_row(b"U" + insert[1:5] + b"X" + insert[6:])
    with pytest.raises(DecodeError, match="'K' or 'O'"):
        po.decode_row(b"D" + insert[1:5] + b"N" + insert[6:])
    with pytest.raises(DecodeError, match="non-UTF-8"):
        po.decode_row(b"I" + insert[1:5] + b"N\x00\x01t\x00\x00\x00\x01\xff")
    with pytest.raises(DecodeError, match="not a row change"):
        po.decode_row(b"B" + bytes(20))


@pytest.mark.skipif(po._decode_row_c is None, reason="the C row decoder was not built (no compiler)")
def test_c_row_decoder_agrees_with_python_and_leaves_errors_to_it():
    for data in set(every_raw()):
        if data[0] not in po.ROW_CHANGES:
            continue
        assert po._decode_row_c(data, UNCHANGED) == po._decode_row_py(data)
        for cut in range(len(data)):  # anything not well-formed: None, and the Python decoder raises
            assert po._decode_row_c(data[:cut], UNCHANGED) is None
        assert po._decode_row_c(data + b"\x00", UNCHANGED) is None
    insert = b"I" + struct.pack(">I", 5) + b"N" + b"\x00\x01" + b"t\x00\x00\x00\x01x"
    assert po._decode_row_c(insert.replace(b"t\x00", b"q\x00"), UNCHANGED) is None
    assert po._decode_row_c(b"I" + insert[1:5] + b"N\x00\x01t\x00\x00\x00\x01\xff", UNCHANGED) is None
    assert po._decode_row_c(b"B" + bytes(20), UNCHANGED) is None
