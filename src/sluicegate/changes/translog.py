"""The transaction-log applier (Drizzle's transaction log): Transaction messages appended to segment files.

Layout: ``DIR/sg-translog.000001``, ``.000002``, … Each file starts with an 8-byte header, ``b"SGTLOG"`` and the
format version (2 bytes, big-endian). Then records, each::

    4 bytes   payload length, big-endian (never 0)
    4 bytes   CRC-32 (zlib.crc32, the ISO-HDLC polynomial; not CRC-32C) of the payload, big-endian
    n bytes   the serialized Transaction

A file is rotated before a record would take it past ``max_bytes``; a record bigger than that gets a file of
its own. With ``fsync=commit`` (the default) the file is flushed and fsynced at every message that ends a
transaction (end_segment), and at every rotation, so :meth:`TranslogApplier.last_position` is always on disk and
a stream may confirm its slot up to it. ``fsync=never`` still flushes at each transaction end (a killed process
loses nothing written), but a machine crash may lose the tail.

Only the writer truncates: a torn last record (the writer died mid-write) at the end of the last file is cut away
with a warning when the log is reopened. A bad record anywhere else is corruption: an error naming the file and
the byte offset. The log is record-exact, not transaction-exact: after a restart, a transaction whose last
segment never made it in is written again from its segment 1 (a reader drops the unfinished earlier run).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator

from google.protobuf.message import DecodeError

from ..errors import TerminalError, UsageError, did_you_mean
from ..position import format_lsn
from .model import Transaction

log = logging.getLogger(__name__)

MAGIC = b"SGTLOG"
VERSION = 1
HEADER = MAGIC + struct.pack(">H", VERSION)
_RECORD = struct.Struct(">II")  # length, crc
PREFIX = "sg-translog."
_NAME = re.compile(r"^sg-translog\.(\d{6,})$")
LOCK_NAME = "sg-translog.lock"
MAX_RECORD = 1 << 30  # protobuf's own limit is 2 GiB; a longer length field is damage, not data
FSYNC_MODES = ("commit", "never")
MIN_MAX_BYTES = 1024

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30}


class CorruptLog(TerminalError):
    """A transaction log that cannot be read on: names the file, the byte offset and what is wrong."""


class _Torn(Exception):
    """The file ends inside a record (or its header): what a writer that died mid-write leaves."""

    def __init__(self, offset: int, what: str):
        super().__init__(what)
        self.offset, self.what = offset, what


def parse_size(text: str | int) -> int:
    """'64MiB' -> 67108864; '512KiB', '1000', '2GB' (decimal) too."""
    if isinstance(text, int):
        return text
    found = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = found and found.group(2).lower()
    if not found or unit not in _UNITS:
        raise UsageError(f"not a size: {text!r} (write bytes, or a number with KiB, MiB, GiB, KB, MB, GB)")
    return int(found.group(1)) * _UNITS[unit]


def file_name(number: int) -> str:
    return f"{PREFIX}{number:06d}"


def log_files(directory: str) -> list[tuple[int, str]]:
    """(number, path) of the directory's segment files, in order."""
    out = []
    for name in os.listdir(directory):
        found = _NAME.match(name)
        if found:
            out.append((int(found.group(1)), os.path.join(directory, name)))
    return sorted(out)


def _records(f, path: str, size: int) -> Iterator[tuple[int, bytes]]:
    """(offset, payload) of every record of an open segment file of `size` bytes.

    Raises _Torn when the file ends inside its header or a record (or ends in a record whose checksum fails,
    or in zero bytes a crash left), CorruptLog for anything else.
    """
    head = f.read(len(HEADER))
    if len(head) < len(HEADER) and MAGIC.startswith(head[:len(MAGIC)]):
        raise _Torn(0, f"the file header is incomplete ({len(head)} of {len(HEADER)} bytes)")
    if len(head) < len(HEADER) or head[:len(MAGIC)] != MAGIC:
        raise CorruptLog(f"{path}: not a Sluicegate transaction log (no {MAGIC.decode()} header)")
    version = struct.unpack(">H", head[len(MAGIC):])[0]
    if version != VERSION:
        raise CorruptLog(f"{path}: transaction log format version {version}; this Sluicegate reads version "
                         f"{VERSION} (upgrade Sluicegate to read it)")
    offset = len(HEADER)
    while offset < size:
        prefix = f.read(_RECORD.size)
        if len(prefix) < _RECORD.size:
            raise _Torn(offset, f"the file ends inside a record's length and checksum ({len(prefix)} of 8 bytes)")
        length, crc = _RECORD.unpack(prefix)
        if length == 0:
            rest = f.read()
            if not (prefix + rest).strip(b"\0"):
                raise _Torn(offset, f"the file ends in {size - offset} zero bytes")
            raise CorruptLog(f"{path}: record at byte {offset} has length 0 (the file is damaged there)")
        end = offset + _RECORD.size + length
        if length > MAX_RECORD:
            if end > size:
                raise _Torn(offset, f"the record claims {length} bytes, the file ends after {size - offset - 8}")
            raise CorruptLog(f"{path}: record at byte {offset} claims {length} bytes (the file is damaged there)")
        payload = f.read(length)
        if len(payload) < length:
            raise _Torn(offset, f"the record claims {length} bytes, the file ends after {len(payload)}")
        if zlib.crc32(payload) != crc:
            if end == size:
                raise _Torn(offset, "the last record's checksum does not match (a write cut short)")
            raise CorruptLog(f"{path}: bad checksum in the record at byte {offset} ({length} bytes): the file is "
                             f"damaged there; records from that byte on cannot be trusted")
        yield offset, payload
        offset = end


def _parse(path: str, offset: int, payload: bytes) -> Transaction:
    txn = Transaction()
    try:
        txn.ParseFromString(payload)
    except DecodeError as exc:  # the checksum is right: something else wrote this record
        raise CorruptLog(f"{path}: the record at byte {offset} is not a Transaction message ({exc})") from None
    return txn


def _read_file(path: str, last: bool) -> Iterator[tuple[str, int, Transaction]]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            for offset, payload in _records(f, path, size):
                yield path, offset, _parse(path, offset, payload)
        except _Torn as torn:
            where = "the last file" if last else "a file that is not the last one"
            raise CorruptLog(f"{path}: incomplete record at byte {torn.offset}: {torn.what} ({where}; a writer "
                             f"that died mid-write leaves this — reopening the log with the translog applier "
                             f"cuts a torn tail of the last file away)") from None


def read_log(path: str) -> Iterator[tuple[str, int, Transaction]]:
    """(file, byte offset, Transaction) of every record of a segment file or of a whole log directory, in order.

    Raises CorruptLog (file, offset, what is wrong) where a record cannot be read, after yielding those before it.
    """
    if os.path.isdir(path):
        files = log_files(path)
        for i, (number, name) in enumerate(files):
            if i and number != files[i - 1][0] + 1:
                raise CorruptLog(f"{path}: {file_name(files[i - 1][0] + 1)} is missing (the log goes from "
                                 f"{os.path.basename(files[i - 1][1])} to {os.path.basename(name)})")
            yield from _read_file(name, last=i == len(files) - 1)
    elif os.path.exists(path):
        later = [p for _, p in log_files(os.path.dirname(path) or ".") if os.path.basename(p) > os.path.basename(path)]
        yield from _read_file(path, last=not later)
    else:
        raise UsageError(f"no transaction log at {path}: name a log directory or one of its sg-translog.* files")


class TranslogApplier:
    """Appends Transaction messages to a transaction log directory (see the module's docstring).

    Options come as strings from a spec: ``translog:dir=/var/lib/sg,max_bytes=64MiB,fsync=commit``.
    Reopening a directory continues after its last complete record; one writer per directory (a lock file).
    """

    def __init__(self, dir: str = "", max_bytes: str = "64MiB", fsync: str = "commit"):
        if not dir:
            raise UsageError("translog needs a directory: translog:dir=/path/to/log")
        if fsync not in FSYNC_MODES:
            raise UsageError(f"translog fsync={fsync!r} is not a mode{did_you_mean(fsync, list(FSYNC_MODES))} "
                             f"(modes: {', '.join(FSYNC_MODES)})")
        self.dir, self.max_bytes, self.fsync = dir, parse_size(max_bytes), fsync
        if self.max_bytes < MIN_MAX_BYTES:
            raise UsageError(f"translog max_bytes={max_bytes} is too small: at least {MIN_MAX_BYTES} bytes")
        if os.path.exists(dir) and not os.path.isdir(dir):
            raise UsageError(f"translog dir={dir} is a file, not a directory")
        os.makedirs(dir, exist_ok=True)
        self._lock = open(os.path.join(dir, LOCK_NAME), "a+b")  # noqa: SIM115 (open until close())
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise UsageError(f"another process writes the transaction log in {dir}: one writer per directory "
                             f"(stop it, or give this stream its own dir=)") from None
        self._file = None
        self._position = 0
        try:
            self._open_existing()
        except BaseException:
            self.close()
            raise

    # -- opening ------------------------------------------------------------------------------------------
    def _open_existing(self) -> None:
        files = log_files(self.dir)
        if not files:
            self._start_file(1)
            return
        number, path = files[-1]
        offsets, size = self._recover(path)
        self._number, self._size = number, size
        self._file = open(path, "ab")  # noqa: SIM115 (open until close())
        self._position = self._find_position(files, offsets)

    def _recover(self, path: str) -> tuple[list[int], int]:
        """Check the last file to its end and cut a torn last record away: (record offsets, good size)."""
        offsets = []
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                for offset, _ in _records(f, path, size):
                    offsets.append(offset)
                return offsets, size
            except _Torn as torn:
                good = max(torn.offset, len(HEADER))
                log.warning("transaction log %s: %s at byte %d; cutting the last %d bytes away (a writer died "
                            "mid-write)", path, torn.what, torn.offset, size - torn.offset)
                if torn.offset == 0:  # the header itself was cut short
                    f.seek(0)
                    f.write(HEADER)
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
                return offsets, good

    def _find_position(self, files: list[tuple[int, str]], offsets: list[int]) -> int:
        """The position of the last record that ends a transaction, searching back from the last file."""
        for i in range(len(files) - 1, -1, -1):
            path = files[i][1]
            with open(path, "rb") as f:
                if i < len(files) - 1:  # an earlier file: read (and check) it through
                    try:
                        offsets = [offset for offset, _ in _records(f, path, os.fstat(f.fileno()).st_size)]
                    except _Torn as torn:
                        raise CorruptLog(f"{path}: incomplete record at byte {torn.offset}: {torn.what} (only the "
                                         f"last file may end that way)") from None
                for offset in reversed(offsets):
                    f.seek(offset)
                    length, _ = _RECORD.unpack(f.read(_RECORD.size))
                    txn = _parse(path, offset, f.read(length))
                    if txn.end_segment:
                        return txn.context.position
        return 0

    def _start_file(self, number: int) -> None:
        path = os.path.join(self.dir, file_name(number))
        if os.path.exists(path):
            raise CorruptLog(f"{path} exists already: the log directory changed under the writer")
        self._file = open(path, "xb")  # noqa: SIM115 (open until close())
        self._file.write(HEADER)
        self._number, self._size = number, len(HEADER)
        if self.fsync != "never":  # the new file's name must survive a crash, or its records are lost with it
            self._file.flush()
            os.fsync(self._file.fileno())
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- writing ------------------------------------------------------------------------------------------
    def apply(self, txn: Transaction) -> None:
        if self._file is None:
            raise UsageError(f"the transaction log in {self.dir} is closed (after close(), or an error while "
                             f"writing: open it again to go on from its last complete record)")
        payload = txn.SerializeToString()
        if not payload:
            raise ValueError("an empty Transaction message (no context, no statements) has nothing to log")
        n = _RECORD.size + len(payload)
        try:
            if self._size > len(HEADER) and self._size + n > self.max_bytes:
                self._rotate()
            self._file.write(_RECORD.pack(len(payload), zlib.crc32(payload)))
            self._file.write(payload)
            self._size += n
            if txn.end_segment:
                self._file.flush()
                if self.fsync == "commit":
                    os.fsync(self._file.fileno())
                self._position = txn.context.position
        except BaseException:
            # A record may be half written (disk full, interrupted): write nothing after it. Reopening the
            # log cuts it away and says where the log stands.
            self._abandon()
            raise

    def _abandon(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def _rotate(self) -> None:
        self._file.flush()
        if self.fsync != "never":  # earlier segments of a transaction must be on disk before its end is
            os.fsync(self._file.fileno())
        self._file.close()
        self._start_file(self._number + 1)

    def last_position(self) -> int:
        """Position (context.position) of the last message written that ended a transaction; 0 if none.

        With fsync=commit it is on disk: a reader may resume from it, a stream may confirm its slot up to it.
        """
        return self._position

    position = last_position  # the Applier protocol's name: where `sluicegate vstream` resumes

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            if self.fsync != "never":
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TranslogApplier(dir={self.dir!r}, max_bytes={self.max_bytes}, fsync={self.fsync!r}, "
                f"position={format_lsn(self._position)})")
