"""The replication protocol's messages (postgres/walsender.py) and ChangeStream's answers to keepalives, over
bytes recorded from a PostgreSQL 15 walsender: a slot at 0/1507530, a row written to an unpublished table,
then one published INSERT. No server: the copy stream is replayed from the recording."""

from __future__ import annotations

import struct

from sluicegate.postgres import walsender
from sluicegate.postgres.replication import ChangeStream

START = 0x1507530
RECORDED = [bytes.fromhex(h) for h in (
    "6b00000000015075300003044435e4d5cc00",  # keepalive at the slot's position
    "6b00000000015075a00003044435e4d71e00",  # keepalive past it: WAL of a table not published, nothing sent
    "7700000000015075a000000000015075a00003044435ec815c4200000000015076800003044435ec8014000002d7",  # Begin
    ("77000000000000000000000000000000000003044435ec81c352000040007075626c6963006974656d73006400020169640000"
     "000017ffffffff006e616d650000000019ffffffff"),  # Relation
    "7700000000015075a000000000015075a00003044435ec81ee49000040004e0002740000000131740000000161",  # Insert
    "7700000000015076b000000000015076b00003044435ec81f44300000000000150768000000000015076b00003044435ec8014",
    "6b00000000015076b00003044435ec820a00",  # keepalive at the commit's end
)]
COMMIT_END = 0x15076B0


def test_keepalive_and_xlogdata_fields():
    assert walsender.keepalive(RECORDED[1]) == (0x15075A0, False)
    assert walsender.keepalive(RECORDED[1][:-1] + b"\x01") == (0x15075A0, True)
    assert walsender.START.unpack_from(RECORDED[2], 1)[0] == 0x15075A0
    assert RECORDED[2][walsender.XLOG_HEADER:][:1] == b"B"


def test_standby_status_says_exactly_the_position():
    msg = walsender.standby_status(COMMIT_END, now=946_684_800 + 1.5)
    kind, written, flushed, applied, clock, reply = struct.unpack(">cQQQqB", msg)
    assert (kind, written, flushed, applied, clock, reply) == (b"r", COMMIT_END, COMMIT_END, COMMIT_END, 1_500_000, 0)


class _Replay:
    """The copy stream of a recording as psycopg.pq.PGconn hands it out; what the client sends is kept."""

    def __init__(self, messages):
        self.pending = [memoryview(m) for m in messages]
        self.sent = []

    def get_copy_data(self, _async):
        return (len(self.pending[0]), self.pending.pop(0)) if self.pending else (0, b"")

    def consume_input(self):
        pass

    def put_copy_data(self, data):
        self.sent.append(walsender_flushed(data))

    def flush(self):
        return 0


def walsender_flushed(status: bytes) -> int:
    return struct.unpack_from(">Q", status, 9)[0]


def _stream(messages) -> tuple[ChangeStream, _Replay]:
    stream = ChangeStream.__new__(ChangeStream)  # the socket's part only: no connection
    stream.confirmed = stream.boundary = START
    stream.in_transaction, stream.ended_by, stream.wal_end, stream.where = False, "", 0, "recorded"
    stream.pg = replay = _Replay(messages)
    return stream, replay


def test_a_keepalive_past_the_confirmed_position_never_moves_the_slot():
    """Guarantee 7: psycopg2 answered a keepalive that came before any data with the keepalive's own WAL end,
    and the slot passed the target's position. An answer now says the confirmed position."""
    asked = RECORDED[1][:-1] + b"\x01"  # the same keepalive, the server asking for a reply
    stream, replay = _stream([RECORDED[0], asked, *RECORDED[2:]])
    got = list(stream.messages(nchanges=100, idle=0, max_seconds=60))
    assert replay.sent == [START]  # the reply: not 0/15075A0
    assert [payload[:1] for _lsn, payload in got] == [b"B", b"R", b"I", b"C"]
    assert got[0][0] == 0x15075A0 and stream.boundary == COMMIT_END and stream.sent_upto == COMMIT_END
    stream.confirm(0x15075A0)  # an older position (a target's standbys): sent as it is
    stream.confirm(COMMIT_END)
    stream.confirm(COMMIT_END)  # already said: nothing more
    assert replay.sent == [START, 0x15075A0, COMMIT_END]


def test_sent_upto_follows_keepalives_between_transactions_only():
    stream, _replay = _stream(RECORDED[:3])
    it = stream.messages(nchanges=100, idle=0, max_seconds=60)
    next(it)  # Begin: inside a transaction nothing is complete
    assert stream.wal_end == 0x15075A0 and stream.sent_upto == 0
