"""The transaction-log applier and reader, and `sluicegate log dump` (pure: files in a temporary directory)."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import zlib
from datetime import datetime, timezone

import pytest
from click.testing import CliRunner

from sluicegate.changes import translog as tl
from sluicegate.changes.plugins import load_applier
from sluicegate.changes.segmenter import Segmenter
from sluicegate.changes.translog import CorruptLog, TranslogApplier, parse_size, read_log
from sluicegate.cli.main import cli
from sluicegate.errors import UsageError
from sluicegate.position import format_lsn
from sluicegate.postgres.assembler import Change
from sluicegate.postgres.pgoutput import Begin, Column, Commit, Relation

T = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)
ITEMS = Relation(16401, "public", "items", "d", (Column(1, "id", 23, -1), Column(0, "note", 25, -1)))


def transactions(n: int, rows: int = 1, first_xid: int = 1000, threshold: int = 1 << 20, note: str = "n"):
    """n committed transactions of `rows` inserts each, as the segmenter turns them into messages."""
    seg = Segmenter("src", threshold=threshold, position=0x1000)
    lsn = 0x2000
    for t in range(n):
        xid = first_xid + t
        events = [Begin(lsn + 10 * rows + 5, T, xid)]
        events += [Change("I", ITEMS, None, (str(xid * 1000 + r), f"{note}-{r}"), lsn + 10 * r) for r in range(rows)]
        events.append(Commit(0, lsn + 10 * rows + 5, lsn + 10 * rows + 8, T))
        lsn += 10 * rows + 100
        for ev in events:
            yield from seg.feed(ev)


def write(directory, msgs, **options) -> int:
    with TranslogApplier(str(directory), **options) as log:
        for msg in msgs:
            log.apply(msg)
        return log.last_position()


def read(path) -> list[tuple[str, int, bytes]]:
    return [(os.path.basename(f), off, txn.SerializeToString()) for f, off, txn in read_log(str(path))]


def files(directory) -> list[str]:
    return [os.path.basename(p) for _, p in tl.log_files(str(directory))]


def record_offsets(path) -> list[tuple[int, int]]:
    """(offset, payload length) of each record of one file, read independently of the module."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"SGTLOG\x00\x01"
    out, pos = [], 8
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        out.append((pos, n))
        pos += 8 + n
    return out


# -- writing, reading, rotating -------------------------------------------------------------------------
def test_messages_round_trip_with_header_length_and_crc32(tmp_path):
    msgs = list(transactions(5, rows=3))
    position = write(tmp_path, msgs)
    assert files(tmp_path) == ["sg-translog.000001"]
    got = read(tmp_path)
    assert [x for _, _, x in got] == [msg.SerializeToString() for msg in msgs]
    # The format, checked byte by byte: header, then length + zlib CRC-32 + payload per record.
    data = (tmp_path / "sg-translog.000001").read_bytes()
    assert data[:8] == b"SGTLOG\x00\x01"
    first = msgs[0].SerializeToString()
    assert data[8:12] == len(first).to_bytes(4, "big")
    assert data[12:16] == zlib.crc32(first).to_bytes(4, "big")
    assert data[16:16 + len(first)] == first
    assert [off for _, off, _ in got] == [off for off, _ in record_offsets(tmp_path / "sg-translog.000001")]
    assert position == msgs[-1].context.position != 0
    # One file can be read on its own too.
    assert read(tmp_path / "sg-translog.000001") == got


def test_rotation_keeps_files_under_max_bytes_and_an_oversized_record_alone(tmp_path):
    small = list(transactions(40, rows=2))
    big = list(transactions(1, rows=200, first_xid=5000))  # one message of ~4 KiB
    assert len(big) == 1 and big[0].ByteSize() > 2048
    msgs = small[:20] + big + small[20:]
    write(tmp_path, msgs, max_bytes="1KiB")
    names = files(tmp_path)
    assert names == [f"sg-translog.{i:06d}" for i in range(1, len(names) + 1)] and len(names) > 4
    sizes = {name: os.path.getsize(tmp_path / name) for name in names}
    alone = [name for name in names if sizes[name] > 1024]
    assert len(alone) == 1 and len(record_offsets(tmp_path / alone[0])) == 1
    assert all(size <= 1024 for name, size in sizes.items() if name != alone[0])
    # Rotation happens only when the next record would not fit.
    for a, b in zip(names, names[1:]):  # noqa: RUF007 (3.10 has no pairwise)
        if a != alone[0] and b != alone[0]:
            first_of_next = record_offsets(tmp_path / b)[0][1] + 8
            assert sizes[a] + first_of_next > 1024
    assert [x for _, _, x in read(tmp_path)] == [msg.SerializeToString() for msg in msgs]


def test_reopen_continues_in_the_last_file_and_reports_the_last_position(tmp_path):
    msgs = list(transactions(10))
    first = write(tmp_path, msgs[:6])
    with TranslogApplier(str(tmp_path)) as log:
        assert log.last_position() == first == msgs[5].context.position
        for msg in msgs[6:]:
            log.apply(msg)
        assert log.last_position() == msgs[-1].context.position
    assert files(tmp_path) == ["sg-translog.000001"]
    assert [x for _, _, x in read(tmp_path)] == [msg.SerializeToString() for msg in msgs]
    with TranslogApplier(str(tmp_path)) as log:
        assert log.last_position() == msgs[-1].context.position


def test_last_position_skips_unfinished_segments_and_searches_earlier_files(tmp_path):
    whole = list(transactions(1, rows=2))
    segmented = list(transactions(1, rows=300, first_xid=2000, threshold=1024))
    assert len(segmented) > 3 and not segmented[0].end_segment
    # The last files hold only segments of a transaction whose end never came.
    write(tmp_path, whole + segmented[:-1], max_bytes="1KiB")
    assert len(files(tmp_path)) > 2
    with TranslogApplier(str(tmp_path), max_bytes="1KiB") as log:
        assert log.last_position() == whole[0].context.position
    # An empty directory has no position; a new one is made.
    assert write(tmp_path / "new" / "log", []) == 0
    assert files(tmp_path / "new" / "log") == ["sg-translog.000001"]


def test_fsync_at_each_transaction_end_with_commit_and_never_with_never(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    msgs = list(transactions(3, rows=100, threshold=1024))  # several segments per transaction
    ends = sum(msg.end_segment for msg in msgs)
    assert ends == 3 and len(msgs) > 6
    with TranslogApplier(str(tmp_path / "c")) as log:
        created = len(calls)  # the first file and its directory entry
        for msg in msgs:
            log.apply(msg)
        assert len(calls) - created == ends
    calls.clear()
    write(tmp_path / "n", msgs, fsync="never")
    assert calls == []
    with pytest.raises(UsageError, match="did you mean 'never'"):
        TranslogApplier(str(tmp_path / "x"), fsync="nevr")


# -- damage -------------------------------------------------------------------------------------------
def _cut(path, n):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - n)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x55]))


@pytest.mark.parametrize("damage", ["cut in the length", "cut in the payload", "bad checksum", "zero tail",
                                    "cut header of a new file"])
def test_torn_tail_of_the_last_file_is_cut_away_with_a_warning(tmp_path, caplog, damage):
    msgs = list(transactions(6))
    write(tmp_path, msgs)
    path = tmp_path / "sg-translog.000001"
    last_offset, last_len = record_offsets(path)[-1]
    kept = 6
    if damage == "cut in the length":
        _cut(path, last_len + 5)
        kept = 5
    elif damage == "cut in the payload":
        _cut(path, 3)
        kept = 5
    elif damage == "bad checksum":
        _flip(path, last_offset + 8 + last_len - 1)
        kept = 5
    elif damage == "zero tail":
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)
    else:
        (tmp_path / "sg-translog.000002").write_bytes(b"SGT")
    # A reader says what is wrong and where, after the good records.
    got = []
    with pytest.raises(CorruptLog, match=r"incomplete record at byte \d+") as err:
        got.extend(read_log(str(tmp_path)))
    assert "sg-translog.00000" in str(err.value)
    assert len(got) == kept
    # The writer cuts the torn tail away, says so, and goes on from the last good record.
    with caplog.at_level(logging.WARNING, logger="sluicegate.changes.translog"), TranslogApplier(str(tmp_path)) as log:
        assert log.last_position() == msgs[kept - 1].context.position
        more = list(transactions(2, first_xid=9000))
        for msg in more:
            log.apply(msg)
    assert "cutting the last" in caplog.text and "sg-translog.00000" in caplog.text
    assert [x for _, _, x in read(tmp_path)] == [msg.SerializeToString() for msg in msgs[:kept] + more]


def test_bad_checksum_before_the_end_is_an_error_naming_file_and_offset(tmp_path):
    msgs = list(transactions(6))
    write(tmp_path, msgs)
    path = tmp_path / "sg-translog.000001"
    offset, length = record_offsets(path)[2]
    _flip(path, offset + 8 + length // 2)
    got = []
    with pytest.raises(CorruptLog) as err:
        got.extend(read_log(str(tmp_path)))
    assert len(got) == 2
    assert f"sg-translog.000001: bad checksum in the record at byte {offset}" in str(err.value)
    size = os.path.getsize(path)
    with pytest.raises(CorruptLog, match=f"at byte {offset}"):
        TranslogApplier(str(tmp_path))
    assert os.path.getsize(path) == size  # nothing was cut
    # Damage to a file that is not the last is also an error, never a truncation.
    write(tmp_path / "two", list(transactions(30)), max_bytes="1KiB")
    assert len(files(tmp_path / "two")) > 1
    first = tmp_path / "two" / "sg-translog.000001"
    _cut(first, 2)
    with pytest.raises(CorruptLog, match="sg-translog.000001: incomplete record .* not the last one"):
        list(read_log(str(tmp_path / "two")))


def test_missing_file_wrong_magic_and_newer_version_are_named(tmp_path):
    msgs = list(transactions(30))
    write(tmp_path, msgs, max_bytes="1KiB")
    assert len(files(tmp_path)) >= 3
    os.remove(tmp_path / "sg-translog.000002")
    with pytest.raises(CorruptLog, match="sg-translog.000002 is missing"):
        list(read_log(str(tmp_path)))
    other = tmp_path / "other"
    other.mkdir()
    (other / "sg-translog.000001").write_bytes(b"PK\x03\x04 not a log at all")
    with pytest.raises(CorruptLog, match="not a Sluicegate transaction log"):
        list(read_log(str(other)))
    (other / "sg-translog.000001").write_bytes(b"SGTLOG\x00\x09")
    with pytest.raises(CorruptLog, match="format version 9"):
        TranslogApplier(str(other))
    with pytest.raises(UsageError, match="no transaction log at"):
        list(read_log(str(tmp_path / "nowhere")))


WRITE_UNTIL_FULL = """
import resource, signal, sys
from tests.unit.test_translog import transactions
from sluicegate.changes.translog import TranslogApplier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.RLIM_INFINITY))
log = TranslogApplier(sys.argv[1], fsync="never")
written = 0
try:
    for msg in transactions(100):
        log.apply(msg)
        written += 1
except OSError as exc:
    print(written, exc.errno)
try:
    log.apply(next(transactions(1)))
except Exception as exc:
    print(exc)
"""


def test_a_failed_write_stops_the_writer_and_reopening_cuts_the_partial_record(tmp_path, caplog):
    out = subprocess.run([sys.executable, "-c", WRITE_UNTIL_FULL, str(tmp_path)], check=False, capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), timeout=60)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    written, code = map(int, first.split())
    assert code == errno.EFBIG and 10 < written < 30
    assert "is closed (after close(), or an error while writing" in second
    with caplog.at_level(logging.WARNING), TranslogApplier(str(tmp_path)) as log:
        assert log.last_position() == list(transactions(written))[-1].context.position
    assert "cutting the last" in caplog.text
    assert [x for _, _, x in read(tmp_path)] == [msg.SerializeToString() for msg in transactions(written)]


def test_one_writer_per_directory(tmp_path):
    with TranslogApplier(str(tmp_path)), pytest.raises(UsageError, match="another process writes the transaction"):
        TranslogApplier(str(tmp_path))
    with TranslogApplier(str(tmp_path)) as log:  # the lock went with the first writer
        log.apply(next(transactions(1)))


# -- options and plugin names ---------------------------------------------------------------------------
def test_sizes_and_spec_options(tmp_path):
    assert [parse_size(s) for s in ("64MiB", "512KiB", "1000", "2GB", "1 kib", "3G")] == \
        [64 << 20, 512 << 10, 1000, 2_000_000_000, 1024, 3 << 30]
    for bad in ("", "12 parsecs", "-1", "1.5MiB"):
        with pytest.raises(UsageError, match="not a size"):
            parse_size(bad)
    with pytest.raises(UsageError, match="too small"):
        TranslogApplier(str(tmp_path), max_bytes="100")
    log = load_applier(f"translog:dir={tmp_path}/spec,max_bytes=1MiB,fsync=never")
    try:
        assert (log.max_bytes, log.fsync, log.dir) == (1 << 20, "never", f"{tmp_path}/spec")
    finally:
        log.close()
    with pytest.raises(UsageError, match="unknown applier 'translg': did you mean 'translog'"):
        load_applier("translg")
    with pytest.raises(UsageError, match="translog needs a directory"):
        load_applier("translog")


# -- sluicegate log dump --------------------------------------------------------------------------------
def test_dump_prints_one_line_per_message_and_json(tmp_path):
    msgs = list(transactions(2, rows=3)) + list(transactions(1, rows=60, first_xid=7000, threshold=1024))
    write(tmp_path, msgs, max_bytes="2KiB")
    runner = CliRunner()
    result = runner.invoke(cli, ["log", "dump", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == len(msgs)
    first = os.path.join(str(tmp_path), "sg-translog.000001")
    assert lines[0] == (f"{first}:8 txn 1000 position {format_lsn(msgs[0].context.position)} segment 1 end "
                        f"INSERT public.items (3 rows)")
    assert lines[2].endswith("segment 1 INSERT public.items (" + str(len(msgs[2].statements[0].rows))
                             + " rows, part 1+)")
    assert " end INSERT public.items" in lines[-1] and "txn 7000" in lines[-1]
    result = runner.invoke(cli, ["log", "dump", "--json", str(tmp_path)])
    assert result.exit_code == 0
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["transaction_id"] for r in rows] == [msg.context.transaction_id for msg in msgs]
    assert rows[0]["file"] == first and rows[0]["offset"] == 8
    assert rows[0]["statements"][0]["rows"][0]["after"] == {"id": "1000000", "note": "n-0"}
    assert {k for k in rows[0]} >= {"file", "offset", "position", "segment_id", "end_segment", "statements"}


def test_dump_exits_1_with_one_line_on_damage(tmp_path):
    write(tmp_path, list(transactions(4)))
    path = tmp_path / "sg-translog.000001"
    offset, length = record_offsets(path)[1]
    _flip(path, offset + 8)
    result = CliRunner().invoke(cli, ["log", "dump", str(tmp_path)])
    assert result.exit_code == 1
    assert len(result.stdout.splitlines()) == 1  # the record before the damage
    assert result.stderr.strip().splitlines() == [
        (f"error: {path}: bad checksum in the record at byte {offset} ({length} bytes): the file is damaged "
         f"there; records from that byte on cannot be trusted")]
    result = CliRunner().invoke(cli, ["log", "dump", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "does not exist" in result.stderr
