"""A Delta target's workflow state: one JSON document, PATH/_sluicegate/workflows/<W>/state.json.

Written whole to a temporary file in the same directory, fsynced, then `os.replace`d over the old one: a
reader (or a restart after kill -9) sees the old document or the new one, never a mix. Read-modify-write
goes under an flock on a sibling lock file, so `workflow stop` and a running driver never lose each other's
change. A second flock (run.lock), held for the driver's life, keeps one driver per workflow; the kernel
drops it when the driver dies. That is `Store`, for local paths (os.replace and flock make it atomic).

On an object store (`delta:s3://...`, any URI delta-rs supports) there is no rename and no flock: `DeltaStore`
keeps each workflow's document as a one-row Delta table, PATH/_sluicegate/workflows/<W>, and one driver per
workflow holds a lease in that row instead of the flock (see DeltaStore).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ... import config
from ...errors import RetryableError, UsageError
from ...postgres.catalog import Table
from ...workflow.loop import COPYING, ERROR, INIT, RUNNING, STOPPED  # noqa: F401 - the states, named here too
from . import durable, location
from .read import _open

log = logging.getLogger("sluicegate")

# The schedule `workflow run` keeps between batches (config.py; commit_every 0: commit as changes come).
# Each commit of changes rewrites the files it touches, so the old versions a retention keeps grow with
# (retention + vacuum period) / commit interval (bench/README.md, "Issue 34: lake size"). A reader using a
# point for longer than the retention (a vdiff beside the driver pins its own) needs a longer one: `lake
# schedule --vacuum-retention`.
HOUSEKEEPING_DEFAULTS = {k: config.default(k) for k in ("optimize_every", "vacuum_every", "vacuum_retention",
                                                           "commit_every")}


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
    rule: dict | None = None  # the table's rule (CompiledRule.to_json()): its Delta table holds the rule's output

    @property
    def spec(self) -> Table:
        """The source table."""
        return Table.from_json(self.table)

    @property
    def compiled(self):
        """The table's CompiledRule, or None."""
        from ...rules.compile import CompiledRule

        return CompiledRule.from_json(self.rule, self.spec) if self.rule else None

    @property
    def lake(self) -> Table:
        """The Delta table's description: the source table's, or its rule's output (rules.py)."""
        if not self.rule:
            return self.spec
        from .rules import lake_table

        return lake_table(self.compiled)

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
    # A Replicate sink (sink.py): its safe time (ISO, only grows) and the retention governor's
    # samples of the source's WAL position, [lsn, unix time], oldest first
    safe_time: str | None = None
    wal_samples: list = field(default_factory=list)
    # Durable stream control (control.py): a hold (reason, no position) or a position to stop at, and why
    stop_position: int | None = None
    stop_reason: str = ""
    # What vacuum keeps for vdiffs comparing beside the driver (pins.py), by vdiff id
    pins: dict = field(default_factory=dict)

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
        d.pop("point_requests", None)  # the point-request protocol's field, written before control.py
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
    def update(self, name: str, depends: tuple[tuple, ...] = ()) -> Iterator[LakeWorkflow]:
        """Read, let the caller change, write back: one atomic replace under the lock (not on an exception).
        (`depends`, the fields the caller's change was decided on, needs nothing here: the lock holds them.)"""
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

    def describe(self, name: str) -> str:
        return f"{self.dir(name) / 'state.json'} (a JSON document replaced atomically)"

    def hold_run_lock(self, name: str, on_lost=None):
        """The driver's lock, held until the returned file is closed (or the process dies). (`on_lost`: for
        DeltaStore's lease; the kernel's lock cannot be lost.)"""
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
        durable.sync_file(d)  # the rename itself survives a crash


def open_store(target) -> Store | DeltaStore:
    """The state store of a `delta:PATH` target (or a Location): files for a local path, Delta for a URI."""
    loc = target if isinstance(target, location.Location) else location.parse(target)
    return Store(Path(loc.uri)) if loc.local else DeltaStore(loc)


def update_retrying(store: Store | DeltaStore, name: str, change, depends: tuple[tuple, ...] = (),
                    attempts: int = 5) -> None:
    """`change(w)` in store.update, again on a fresh document when a concurrent commit collided with it (a
    DeltaStore's RetryableError): for commands that write beside a running driver."""
    for attempt in range(attempts):
        try:
            with store.update(name, depends=depends) as w:
                change(w)
            return
        except RetryableError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1 * (attempt + 1))


@functools.cache
def _doc_schema():
    import pyarrow as pa

    return pa.schema([pa.field("doc", pa.string()), pa.field("lease", pa.string())])


LEASE_SECONDS = 30.0  # a driver renews its lease every third of this; a killed one's lease lapses after it
# Versions between checkpoint + log cleanup + vacuum of a state table: a read loads the log entries since the
# last checkpoint, one request each on an object store.
MAINTAIN_EVERY = 20


def _merge(base, mine, theirs):
    """Three-way merge of JSON values: what `mine` changed from `base`, applied over `theirs`."""
    if mine == base:
        return theirs
    if isinstance(base, dict) and isinstance(mine, dict) and isinstance(theirs, dict):
        out = dict(theirs)
        for k in set(base) | set(mine):
            if k not in mine:
                out.pop(k, None)
            else:
                out[k] = _merge(base.get(k), mine[k], theirs.get(k))
        return out
    if (isinstance(base, list) and isinstance(mine, list) and isinstance(theirs, list)
            and len(base) == len(mine) == len(theirs)):
        return [_merge(b, m, t) for b, m, t in zip(base, mine, theirs)]
    return mine


def _changed(base, new, path=()) -> set[tuple]:
    """The paths of the leaves (dict keys, list items of same-length lists) where `new` differs from `base`."""
    if base == new:
        return set()
    if isinstance(base, dict) and isinstance(new, dict):
        out = set()
        for k in set(base) | set(new):
            out |= _changed(base.get(k), new.get(k), (*path, k)) if k in base and k in new else {(*path, k)}
        return out
    if isinstance(base, list) and isinstance(new, list) and len(base) == len(new):
        return set().union(*(_changed(b, n, (*path, i)) for i, (b, n) in enumerate(zip(base, new))))
    return {path}


def _overlap(a: set[tuple], b: set[tuple]) -> tuple | None:
    """A path of `a` that is, contains or lies in one of `b`."""
    for p in a:
        for q in b:
            if p[:len(q)] == q or q[:len(p)] == p:
                return p
    return None


def _why(exc: Exception) -> str:
    """delta-rs's error in one line: its first line and its innermost cause."""
    import re

    lines = [re.sub(r"\x1b\[[0-9;]*m|↳", "", ln).strip() for ln in str(exc).splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]}: {lines[-1]}"


class _Read:
    def __init__(self, dt, doc: dict | None, lease: dict | None):
        self.dt, self.doc, self.lease = dt, doc, lease


class DeltaStore:
    """Workflow documents on any store delta-rs supports: PATH/_sluicegate/workflows/<W>, a Delta table of one
    row (doc: the state JSON, lease: the running driver's lease JSON).

    Every change is one overwrite commit of that row, made at the version it read and never rebased
    (max_commit_retries=0): the store's put-if-absent of the log entry makes it atomic, and a concurrent change
    (`workflow stop` while the driver writes) fails the commit instead of being lost. `update` then reads the
    new version and applies the caller's changes to it again (a three-way merge of the JSON: the fields the
    caller changed, over the fresh document), so each change lands once, in commit order. When the other
    commit changed one of the same fields, the caller's change was computed from a stale value: that is a
    RetryableError (the driver's loop steps again; a command says to run it again), never a lost update.

    One driver per workflow: a lease (driver id, host, pid, expiry) that a thread of the driver renews. Taking
    it is such a commit too, so of two drivers started at once, one commits and the other, reading again,
    finds the lease held. A lease lapses when not renewed (killed driver), at once when its holder is a dead
    process of this host. A driver that finds its lease taken stops (its data commits are idempotent by app
    transaction anyway). Every MAINTAIN_EVERY versions the table is checkpointed and its old log entries and
    removed files deleted, so it stays small however long the workflow runs.
    """

    def __init__(self, loc: location.Location):
        self.location = loc
        self.root = loc.uri
        self.base = loc.join("_sluicegate", "workflows")

    def dir(self, name: str) -> str:
        return f"{self.base}/{name}"

    def describe(self, name: str) -> str:
        return f"{self.dir(name)} (a one-row Delta table: each change is a commit)"

    # --- reading and committing the row -------------------------------------------------------------------

    def _read(self, name: str) -> _Read | None:
        import pyarrow.dataset as ds


        for attempt in range(5):
            try:
                dt = _open(self.dir(name))
            except OSError as exc:  # delta-rs: no such bucket, no credentials, store unreachable
                raise RetryableError(f"state of workflow {name} at {self.dir(name)}: cannot read it "
                                     f"({_why(exc)}); check the store's address and the credentials in the "
                                     f"environment (AWS_*, AZURE_*, GOOGLE_*)") from None
            if dt is None:
                return None
            try:
                fs, paths = location.filesystem(location.file_uris(dt)[0]) if dt.file_uris() else (None, None)
                if fs is None:
                    return _Read(dt, None, None)
                row = ds.dataset([paths], schema=_doc_schema(), filesystem=fs).to_table().to_pylist()
            except (FileNotFoundError, OSError):
                # the version's file was removed by a newer version and vacuumed since: read the newer one
                if attempt == 4:
                    raise
                continue
            if not row:
                return _Read(dt, None, None)
            doc, lease = row[0]["doc"], row[0]["lease"]
            return _Read(dt, json.loads(doc) if doc else None, json.loads(lease) if lease else None)

    def _commit(self, name: str, read: _Read | None, doc: dict, lease: dict | None) -> bool:
        """The row as (doc, lease) at the version `read` saw; False when another commit came first."""
        import pyarrow as pa
        from deltalake import CommitProperties, write_deltalake
        from deltalake.exceptions import CommitFailedError, DeltaError

        row = pa.table({"doc": [json.dumps(doc, sort_keys=True, default=str)],
                        "lease": [json.dumps(lease) if lease else None]}, schema=_doc_schema())
        try:
            if read is None:
                write_deltalake(self.dir(name), row, mode="error", name=f"sluicegate state {name}",
                                configuration={"delta.logRetentionDuration": "interval 1 minute"})
            else:
                write_deltalake(read.dt, row, mode="overwrite",
                                commit_properties=CommitProperties(max_commit_retries=0))
        except CommitFailedError:
            return False
        except DeltaError as exc:
            if read is None and "already exists" in str(exc):
                return False
            raise
        if read is not None and (read.dt.version() + 1) % MAINTAIN_EVERY == 0:
            self._maintain(name)
        return True

    def _maintain(self, name: str) -> None:
        try:
            dt = _open(self.dir(name))
            dt.create_checkpoint()
            dt.cleanup_metadata()
            # Files a newer version removed (a reader of an old version then reads again); not full=True at
            # once: a concurrent writer's file not yet committed is no version's and must stay.
            dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
            # Files of commits that lost a race (no version's), once surely no writer's any more.
            dt.vacuum(retention_hours=1, enforce_retention_duration=False, dry_run=False, full=True)
        except Exception as exc:  # noqa: BLE001 - the next maintenance tries again
            log.debug("maintenance of state %s: %s", self.dir(name), exc)

    def _not_found(self, name: str) -> UsageError:
        known = ", ".join(self.names()) or "none"
        return UsageError(f"workflow {name!r} not found under {self.root} (workflows there: {known})")

    # --- the Store interface ------------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        r = self._read(name)
        return r is not None and r.doc is not None

    def names(self) -> list[str]:
        import pyarrow.fs as pafs

        fs, path = location.filesystem(self.base)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except OSError:
            return []
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory and self.exists(i.base_name))

    def load(self, name: str) -> LakeWorkflow:
        r = self._read(name)
        if r is None or r.doc is None:
            raise self._not_found(name)
        return LakeWorkflow.from_json(r.doc)

    def create(self, wf: LakeWorkflow) -> None:
        wf.created_at = wf.updated_at = time.time()
        r = self._read(wf.name)
        if (r is not None and r.doc is not None) or not self._commit(wf.name, r, wf.to_json(), None):
            raise UsageError(f"workflow {wf.name!r} already exists under {self.root}: pick another name, "
                             f"or `sluicegate workflow delete {wf.name} --target delta:{self.root}`")

    @contextlib.contextmanager
    def update(self, name: str, depends: tuple[tuple, ...] = ()) -> Iterator[LakeWorkflow]:
        """Read, let the caller change, commit; on a concurrent commit, the caller's changes again over the
        newer document (not on an exception). A RetryableError when that commit changed a field the caller
        changed, or one in `depends` (paths the caller read to decide, e.g. ("tables",)): the caller's block
        ran once, on the older document."""
        r = self._read(name)
        if r is None or r.doc is None:
            raise self._not_found(name)
        base = json.loads(json.dumps(r.doc))
        wf = LakeWorkflow.from_json(r.doc)
        yield wf
        wf.updated_at = base["updated_at"] = time.time()  # (not a change that can collide)
        mine = json.loads(json.dumps(wf.to_json(), default=str))
        changed = _changed(base, mine)
        for attempt in range(100):
            if not changed:
                return
            if self._commit(name, r, _merge(base, mine, r.doc) if attempt else mine, r.lease):
                return
            r = self._read(name)
            if r is None or r.doc is None:
                raise self._not_found(name)
            theirs = _changed(base, r.doc) - {("updated_at",)}
            clash = _overlap(changed | set(depends), theirs)
            if clash:
                raise RetryableError(f"workflow {name}: its state field {'.'.join(map(str, clash))} changed "
                                     f"under this update (another command or driver wrote it); run it again")
            time.sleep(min(0.05 * attempt, 0.5))  # others commit meanwhile: let the store settle
        raise RetryableError(f"state of workflow {name} under {self.root}: 100 concurrent commits in a row; "
                             f"will retry")

    def delete(self, name: str) -> None:
        fs, path = location.filesystem(self.dir(name))
        with contextlib.suppress(FileNotFoundError):
            fs.delete_dir(path)

    def _lease_holder(self, lease: dict | None, now: float) -> dict | None:
        """The lease if it binds now: unexpired, and not held by a dead process of this host."""
        if not lease or lease.get("expires", 0) <= now:
            return None
        if lease.get("host") == socket.gethostname():
            from ...procs import pid_alive

            if not pid_alive(int(lease.get("pid", 0))):
                return None
        return lease

    def is_running(self, name: str) -> bool:
        r = self._read(name)
        return r is not None and self._lease_holder(r.lease, time.time()) is not None

    def hold_run_lock(self, name: str, on_lost=None) -> _Lease:
        """Take the workflow's lease (or fail saying who holds it); renewed until the returned lease is closed.
        `on_lost()` runs if another driver takes it meanwhile (after ours lapsed)."""
        lease = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        while True:
            r = self._read(name)
            if r is None or r.doc is None:
                raise self._not_found(name)
            held = self._lease_holder(r.lease, time.time())
            if held is not None:
                raise UsageError(f"workflow {name!r} is already being run by another `sluicegate workflow run` "
                                 f"(pid {held.get('pid')} on {held.get('host')}; its lease lapses in "
                                 f"{max(0, held['expires'] - time.time()):.0f}s unless renewed)")
            lease["expires"] = time.time() + LEASE_SECONDS
            if self._commit(name, r, r.doc, lease):
                return _Lease(self, name, lease, on_lost)

    def _renew(self, name: str, lease: dict, release: bool = False) -> bool:
        """Extend (or drop) our lease; False when it is not ours any more."""
        while True:
            r = self._read(name)
            if r is None or r.doc is None or not r.lease or r.lease.get("id") != lease["id"]:
                return False
            new = None if release else dict(lease, expires=time.time() + LEASE_SECONDS)
            if self._commit(name, r, r.doc, new):
                if new:
                    lease.update(new)
                return True


class _Lease:
    """A held lease: a thread renews it; close() drops it."""

    def __init__(self, store: DeltaStore, name: str, lease: dict, on_lost):
        self.store, self.name, self.lease, self.on_lost = store, name, lease, on_lost
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._keep, daemon=True, name=f"sg-lease-{name}")
        self.thread.start()

    def _keep(self) -> None:
        while not self.done.wait(LEASE_SECONDS / 3):
            try:
                ours = self.store._renew(self.name, self.lease)
            except Exception as exc:  # noqa: BLE001 - the store may be unreachable a while: try again
                log.warning("could not renew the lease of workflow %s: %s", self.name, exc)
                ours = time.time() < self.lease["expires"]
            if not ours:
                log.error("workflow %s: another driver took its lease; this one stops", self.name)
                if self.on_lost:
                    self.on_lost()
                return

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        try:
            self.store._renew(self.name, self.lease, release=True)
        except Exception as exc:  # noqa: BLE001 - it lapses by itself
            log.warning("could not release the lease of workflow %s: %s", self.name, exc)
