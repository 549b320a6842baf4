"""The streaming replication protocol's messages inside a START_REPLICATION copy stream: pure, no I/O.

The walsender sends XLogData ('w': data start, WAL end, send time, then one pgoutput message) and primary
keepalives ('k': WAL end, send time, reply requested); the client answers with standby status updates ('r').
Sluicegate writes its own answers rather than psycopg2's, which moves its flush position to a keepalive's WAL
end on its own and sends that: the slot would then pass the target's durable position (guarantee 7). Here a
status carries exactly the position the caller gives, and nothing else moves it.
"""

from __future__ import annotations

import struct
import time

XLOG_DATA, KEEPALIVE = ord("w"), ord("k")
XLOG_HEADER = 1 + 8 + 8 + 8  # kind, data start, WAL end, send time
START = struct.Struct(">Q")  # an XLogData's data start, at offset 1
_KEEPALIVE = struct.Struct(">QQB")  # WAL end, send time, reply requested
_STATUS = struct.Struct(">cQQQqB")  # 'r', written, flushed, applied, client time, reply requested
_PG_EPOCH = 946_684_800  # 2000-01-01 in Unix seconds: the protocol's timestamps count from it


def keepalive(message) -> tuple[int, bool]:
    """A primary keepalive's (WAL end, whether the server asks for a reply now)."""
    wal_end, _sent, reply = _KEEPALIVE.unpack_from(message, 1)
    return wal_end, bool(reply)


def standby_status(position: int, now: float | None = None) -> bytes:
    """A standby status update saying everything before `position` is written, flushed and applied: the
    server confirms a logical slot up to the flushed position (0 would leave it where it is)."""
    now = time.time() if now is None else now
    return _STATUS.pack(b"r", position, position, position, int((now - _PG_EPOCH) * 1_000_000), 0)
