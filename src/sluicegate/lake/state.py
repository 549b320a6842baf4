"""A Delta target's workflow state: one JSON document, PATH/_sluicegate/workflows/<W>/state.json.

Written whole to a temporary file in the same directory, fsynced, then `os.replace`d over the old one: a
reader (or a restart after kill -9) sees the old document or the new one, never a mix. Read-modify-write
goes under an flock on a sibling lock file, so `workflow stop` and a running driver never lose each other's
change. A second flock (run.lock), held for the driver's life, keeps one driver per workflow; the kernel
drops it when the driver dies. Local paths only (os.replace and flock are what make it atomic).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..postgres.catalog import Table

INIT, COPYING, RUNNING, STOPPED, ERROR = "Init", "Copying", "Running", "Stopped", "Error"
# Housekeeping `workflow run` does between batches: seconds between runs (0: never), vacuum's retention.
HOUSEKEEPING_DEFAULTS = {"optimize_every": 3600.0, "vacuum_every": 86400.0, "vacuum_retention": 7 * 86400.0}
PREFIX = "delta:"


def lake_path(target: str) -> Path:
    """`delta:PATH` -> PATH (a local directory)."""
    raw = target.removeprefix(PREFIX)
    raw = raw.removeprefix("file://")
    if "://" in raw:
        raise UsageError(f"target {target}: the Delta target keeps its state with local-file atomicity; "
                         f"name a local directory (delta:/path/to/lake)")
    if not raw:
        raise UsageError("target delta: names no directory: delta:/path/to/lake")
    return Path(raw).expanduser().resolve()


def is_lake(target: str | None) -> bool:
    return bool(target) and target.startswith(PREFIX)


def table_path(root: Path, qualified_schema: str, name: str) -> Path:
    return root / qualified_schema / name


def app_id(workflow: str) -> str:
    """The app transaction id every commit of this workflow's changes carries."""
    return f"sluicegate:{workflow}"


def copy_app_id(workflow: str) -> str:
    """The app id of copy cycles' commits (version: the table's cycle number)."""
    return f"sluicegate:{workflow}:copy"


@dataclass
class TableState:
    table: dict  # Table.to_json()
    lastpk: list | None = None
    done: bool = False
    rows_copied: int = 0
    cycles: int = 0  # copy cycles committed: the next one's number is cycles + 1
    copy_from: int | None = None  # snapshot position of the table's first copy cycle
    copied_to: int | None = None  # snapshot position of its last one
    applied: int | None = None  # the last batch end position committed to this table

    @property
    def spec(self) -> Table:
        return Table.from_json(self.table)

    @property
    def qualified(self) -> str:
        return f"{self.table['schema']}.{self.table['name']}"


@dataclass
class LakeWorkflow:
    name: str
    source_url: str
    slot: str
    publication: str
    tables: list[TableState]
    state: str = INIT
    message: str = ""
    position: int | None = None
    kind: str = "MoveTables"
    options: dict = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    transaction_time: str | None = None  # source commit time of the last applied transaction (ISO)
    caught_up_at: float | None = None  # when the stream last had nothing left to read
    first_point: bool = False  # the copy's point is written: readers have a consistent point
    housekeeping: dict = field(default_factory=dict)  # "optimize"/"vacuum" -> when the driver last ran it
    # A Replicate sink (cluster/lake_sink.py): its safe time (ISO, only grows) and the retention governor's
    # samples of the source's WAL position, [lsn, unix time], oldest first
    safe_time: str | None = None
    wal_samples: list = field(default_factory=list)

    def table(self, qualified: str) -> TableState:
        for t in self.tables:
            if t.qualified == qualified:
                return t
        raise KeyError(qualified)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LakeWorkflow:
        d = dict(d)
        d["tables"] = [TableState(**t) for t in d["tables"]]
        return cls(**d)


class Store:
    """The state documents of the workflows under one lake root."""

    def __init__(self, root: Path):
        self.root = root
        self.base = root / "_sluicegate" / "workflows"

    def dir(self, name: str) -> Path:
        return self.base / name

    def exists(self, name: str) -> bool:
        return (self.dir(name) / "state.json").exists()

    def names(self) -> list[str]:
        if not self.base.exists():
            return []
        return sorted(p.name for p in self.base.iterdir() if (p / "state.json").exists())

    def load(self, name: str) -> LakeWorkflow:
        path = self.dir(name) / "state.json"
        try:
            return LakeWorkflow.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            known = ", ".join(self.names()) or "none"
            raise UsageError(f"workflow {name!r} not found under {self.root} (workflows there: {known})") from None

    def create(self, wf: LakeWorkflow) -> None:
        self.dir(wf.name).mkdir(parents=True, exist_ok=True)
        with self._locked(wf.name):
            if self.exists(wf.name):
                raise UsageError(f"workflow {wf.name!r} already exists under {self.root}: pick another name, "
                                 f"or `sluicegate workflow delete {wf.name} --target delta:{self.root}`")
            wf.created_at = wf.updated_at = time.time()
            self._write(wf)

    @contextlib.contextmanager
    def update(self, name: str) -> Iterator[LakeWorkflow]:
        """Read, let the caller change, write back: one atomic replace under the lock (not on an exception)."""
        with self._locked(name):
            wf = self.load(name)
            yield wf
            wf.updated_at = time.time()
            self._write(wf)

    def delete(self, name: str) -> None:
        d = self.dir(name)
        for p in ("state.json", "lock", "run.lock"):
            with contextlib.suppress(FileNotFoundError):
                (d / p).unlink()
        with contextlib.suppress(OSError):
            d.rmdir()

    def hold_run_lock(self, name: str):
        """The driver's lock, held until the returned file is closed (or the process dies)."""
        self.dir(name).mkdir(parents=True, exist_ok=True)
        f = open(self.dir(name) / "run.lock", "a+")  # noqa: SIM115 - held for the driver's life
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise UsageError(f"workflow {name!r} is already being run by another `sluicegate workflow run`") from None
        return f

    def is_running(self, name: str) -> bool:
        """A driver holds the run lock now."""
        path = self.dir(name) / "run.lock"
        if not path.exists():
            return False
        with open(path, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        self.dir(name).mkdir(parents=True, exist_ok=True)
        with open(self.dir(name) / "lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _write(self, wf: LakeWorkflow) -> None:
        d = self.dir(wf.name)
        fd, tmp = tempfile.mkstemp(prefix=".state.", suffix=".tmp", dir=d)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(wf.to_json(), f, indent=1, sort_keys=True, default=str)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, d / "state.json")
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)
