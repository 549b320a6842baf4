"""The retention governor: caps on the WAL a lagging sink's slot holds on the source.

A slot per sink keeps the source's WAL for the slowest sink (YugabyteDB's retention by the minimum replicated
op id). A sink gone for days must not fill the source's disk, so `--max-retained-wal` and
`--max-retention-age` cap what any one sink's slot may hold. Every sink's consumer (`workflow run W --target
SINK`) runs a governor over all the workflow's sinks, so a sink whose own consumer is down is still governed
while any other runs. Past a cap, the governor releases that sink's slot (and only that one): first it says
why in the comment of the sink's publication, then drops the slot, then (if it can reach the sink) puts the
sink's streams in Error with that reason and the bootstrap command. Nothing is skipped: the sink cannot
resume without a bootstrap, and says so. A slot with a reader is left alone: its sink is catching up. So is
one whose sink's consumer is alive (its heartbeat is fresh): between catchups (a long copy) nothing reads
the slot, but that sink is not gone.

The age of the WAL a slot holds is measured from samples of the source's WAL position (lsn, source clock)
the governor keeps in its sink's state: the oldest WAL a slot holds (its restart_lsn) was written before the
first sample past it. That errs on the young side by at most one sample interval: a cap is never applied early.

A Delta sink (targets/delta/sink.py) keeps its samples in its state document, and its liveness is its run lock or a
state document written lately; released, its state goes to Error when its directory is reachable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg

from ..appliers import lww
from ..position import format_lsn, parse_lsn
from ..postgres import capture
from ..postgres.connect import connect, describe
from ..sizes import format_size
from ..workflow import state as st
from ..workflow.heartbeat import is_running
from .model import Cluster
from .sinks import kind_of

log = logging.getLogger("sluicegate")
SAMPLE_EVERY = timedelta(seconds=10)  # one sample of the source's WAL position per this long, at most
KEEP_SAMPLES = timedelta(days=8)  # history enough for any age shown or capped (longer caps keep longer)
GC_INTERVAL = 60.0  # seconds between tombstone collections of a bidirectional side
TOMBSTONE_RETENTION = 7 * 86400.0  # seconds: --tombstone-retention's default


@dataclass(frozen=True)
class SlotHold:
    sink: str
    slot: str
    exists: bool
    retained_bytes: int | None = None
    age_seconds: float | None = None
    wal_status: str | None = None
    active: bool = False
    released: str | None = None  # the governor's note, once it released the slot
    shard: str | None = None  # the source shard whose slot this is (a keyspace source), else None

    def to_json(self) -> dict:
        shard = {"source_shard": self.shard} if self.shard is not None else {}
        return {"sink": self.sink, **shard, "slot": self.slot, "exists": self.exists,
                "retained_wal_bytes": self.retained_bytes,
                "retained_age_seconds": round(self.age_seconds, 1) if self.age_seconds is not None else None,
                "wal_status": self.wal_status, "active": self.active, "released": self.released}


def holds(src: psycopg.Connection, samples, cluster: Cluster, shard: str | None = None) -> list[SlotHold]:
    """What each sink's slot holds on the source now (`samples`: PgSamples or a sink kind's, which date the
    WAL); on
    source shard `shard`'s (`src`) for a keyspace source, whose WAL is not sampled (no age)."""
    out = []
    now = src.execute("SELECT clock_timestamp()").fetchone()[0]
    for sink in cluster.sinks:
        slot = cluster.slot(sink, shard)
        row = src.execute(
            """SELECT restart_lsn::text, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, wal_status,
                      active_pid IS NOT NULL
               FROM pg_replication_slots WHERE slot_name = %s""", (slot,)).fetchone()
        if row is None:
            out.append(SlotHold(sink, slot, False, released=capture.release_note(src, slot), shard=shard))
            continue
        restart, held, wal_status, active = row
        age = samples.age(parse_lsn(restart), now) if restart and shard is None else None
        out.append(SlotHold(sink, slot, True, held, age, wal_status, active, shard=shard))
    return out


class PgSamples:
    """The governor's samples of the source's WAL position, in a PostgreSQL sink's `sluicegate.wal_samples`
    (a Delta sink keeps its own: targets/delta/sink.py's LakeSamples, the same two methods)."""

    def __init__(self, conn: psycopg.Connection, workflow: str):
        self.conn, self.workflow = conn, workflow

    def add(self, lsn: int, now: datetime, every: timedelta, keep: timedelta) -> None:
        conn = self.conn
        last = conn.execute("SELECT max(taken_at) FROM sluicegate.wal_samples WHERE workflow = %s",
                            (self.workflow,)).fetchone()[0]
        if last is None or now - last >= every:
            conn.execute("INSERT INTO sluicegate.wal_samples (workflow, lsn, taken_at) VALUES (%s, %s::pg_lsn, %s) "
                         "ON CONFLICT DO NOTHING", (self.workflow, format_lsn(lsn), now))
            conn.execute("DELETE FROM sluicegate.wal_samples WHERE workflow = %s AND taken_at < %s",
                         (self.workflow, now - keep))
        conn.commit()

    def age(self, restart: int, now: datetime) -> float:
        """Seconds since the first sample past `restart` (0 if none is)."""
        row = self.conn.execute("SELECT min(taken_at) FROM sluicegate.wal_samples WHERE workflow = %s "
                                "AND lsn > %s::pg_lsn", (self.workflow, format_lsn(restart))).fetchone()
        self.conn.rollback()
        return max(0.0, (now - row[0]).total_seconds()) if row and row[0] else 0.0


def over_cap(hold: SlotHold, cluster: Cluster) -> str | None:
    """Which cap a slot is past, in words; None if within both."""
    if cluster.max_retained_wal is not None and (hold.retained_bytes or 0) > cluster.max_retained_wal:
        return (f"it held {format_size(hold.retained_bytes)} of WAL, over --max-retained-wal "
                f"{format_size(cluster.max_retained_wal)}")
    if cluster.max_retention_age is not None and (hold.age_seconds or 0) > cluster.max_retention_age:
        return (f"it held WAL written {_duration(hold.age_seconds)} ago, over --max-retention-age "
                f"{_duration(cluster.max_retention_age)}")
    return None


def releasable(hold: SlotHold, cluster: Cluster, alive: Callable[[str], bool]) -> str | None:
    """Why a sink's slot is to be released (the cap it is past), or None. Only an idle slot of another sink
    whose consumer does not beat (`alive`): a slot idle between its catchups (a long copy) belongs to a sink
    that is there, and this consumer's own sink is alive by definition (PostgreSQL's max_slot_wal_keep_size
    governs that one, as the README says)."""
    if not hold.exists or hold.active or hold.sink == cluster.sink:
        return None
    why = over_cap(hold, cluster)
    return None if why is None or alive(hold.sink) else why


class Governor:
    """Runs in a sink's consumer: samples the source's WAL position and enforces the caps, every `interval`."""

    def __init__(self, target_url: str, workflow: str, stop: threading.Event, interval: float = 5.0):
        self.target_url, self.workflow, self.stop, self.interval = target_url, workflow, stop, interval
        self.last_gc = float("-inf")  # monotonic time of the last tombstone collection (bidirectional)
        self.thread = threading.Thread(target=self._run, name="sg-governor", daemon=True)

    def start(self) -> Governor:
        self.thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """The consumer is leaving (its stop event may not be set: the stream went to Error). Waits for a round
        in flight: a thread still inside pyarrow's S3 client or psycopg while the interpreter finalizes can
        crash the process (SIGSEGV at exit), and a release half done should finish."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.check_once()
            except Exception as exc:  # noqa: BLE001 - a source or sink that is down: try again next time
                log.debug("retention governor of %s: %s", self.workflow, exc)
            self.stop.wait(self.interval)

    def check_once(self) -> list[str]:
        """One round: a sample, then every sink's slot against the caps. What was released, as notes."""
        kind = kind_of(self.target_url)
        if kind is not None:  # a Delta sink's consumer: its samples are in its state document
            samples, cluster = kind.samples(self.target_url, self.workflow)
            return self._check_source(samples, cluster, cluster.source_url, None)
        with connect(self.target_url, role="target", connect_timeout=5) as sink_conn:
            cluster = Cluster.of(st.load_workflow(sink_conn, self.workflow))
            if cluster.bidirectional and time.monotonic() - self.last_gc >= GC_INTERVAL:
                self.collect(sink_conn, cluster)
            released = []
            for shard, url in cluster.sources.items():  # a keyspace source: each shard's slots, on it
                released += self._check_source(PgSamples(sink_conn, self.workflow), cluster, url,
                                               shard if cluster.source_shards else None)
        return released

    def _check_source(self, samples, cluster: Cluster, url: str, shard: str | None) -> list[str]:
        released = []
        with connect(url, role="source", autocommit=True, connect_timeout=5) as src:
            if shard is None:  # the samples date one server's WAL
                _sample(src, samples, cluster)
            for hold in holds(src, samples, cluster, shard):
                why = releasable(hold, cluster, lambda sink: _consumer_alive(cluster, sink))
                if why and (note := _release(src, cluster, hold, why)):
                    released.append(note)
                    _tell_sink(cluster, hold.sink, note, hold.slot)
        return released

    def collect(self, conn: psycopg.Connection, cluster: Cluster) -> int:
        """Tombstones older than the workflow's retention, on this side (the sink's own); how many went."""
        retention = timedelta(seconds=cluster.tombstone_retention or TOMBSTONE_RETENTION)
        gone = lww.collect_tombstones(conn, retention)
        conn.commit()
        self.last_gc = time.monotonic()
        return gone


def _sample(src: psycopg.Connection, samples, cluster: Cluster) -> None:
    lsn, now = src.execute("SELECT pg_current_wal_lsn()::text, clock_timestamp()").fetchone()
    samples.add(parse_lsn(lsn), now, SAMPLE_EVERY, max(KEEP_SAMPLES, timedelta(seconds=2 * (cluster.max_retention_age
                                                                                          or 0))))


def _release(src: psycopg.Connection, cluster: Cluster, hold: SlotHold, why: str) -> str | None:
    """Drop the sink's slot, its reason first on the publication (a consumer that finds the slot gone reads
    it). None if the slot got a reader (or vanished), or another sink's governor is releasing it, meanwhile.

    A consumer may start reading between our look and the drop: then the drop fails (the slot is in use) and
    the slot stays. Or it checks the slot just before the drop and connects just after: its stream then fails
    to start, it looks again, finds the slot gone with our note, and goes to Error; nothing is skipped."""
    # Every sink's consumer governs every slot: one at a time, or a governor whose drop finds the slot already
    # gone would clear the note the other one just wrote.
    if not src.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (hold.slot,)).fetchone()[0]:
        return None
    try:
        info = capture.slot_info(src, hold.slot)
        if info is None or info.active_pid:
            return None
        now = src.execute("SELECT clock_timestamp()").fetchone()[0]
        note = (f"the retention governor released replication slot {hold.slot} of sink {hold.sink} at "
                f"{now:%Y-%m-%d %H:%M:%S %Z}: {why}")
        capture.set_release_note(src, hold.slot, note)
        try:
            src.execute("SELECT pg_drop_replication_slot(%s)", (hold.slot,))
        except (psycopg.errors.ObjectInUse, psycopg.errors.UndefinedObject):
            capture.set_release_note(src, hold.slot, None)
            return None
    finally:
        src.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (hold.slot,))
    log.warning("%s; %s", note, cluster.way_out(hold.sink))
    return note


def _consumer_alive(cluster: Cluster, sink: str) -> bool:
    """Whether the sink's consumer beats (workflow/heartbeat.py); an unreachable sink's is not."""
    kind = kind_of(cluster.sinks[sink])
    if kind is not None:
        return kind.alive(cluster.sinks[sink], cluster.workflow)
    try:
        with connect(cluster.sinks[sink], role="target", connect_timeout=3) as conn:
            return is_running(st.load_workflow(conn, cluster.workflow).driver)
    except Exception:  # noqa: BLE001 - down, or deleted there: nothing beats
        return False


def _tell_sink(cluster: Cluster, sink: str, note: str, slot: str) -> None:
    """Best effort: put the sink's streams that read the released slot in Error now (it may be the server that
    is down; its consumer then finds the slot gone, and the note, when it starts). A stream that a bootstrap
    has just sent back to Init no longer needs the slot: left alone."""
    try:
        kind = kind_of(cluster.sinks[sink])
        if kind is not None:  # reachable if its directory is (targets/delta/sink.py)
            kind.tell(cluster.sinks[sink], cluster.workflow, slot, f"{note}; {cluster.way_out(sink)}")
            return
        with connect(cluster.sinks[sink], role="target", connect_timeout=3) as conn:
            wf = st.load_workflow(conn, cluster.workflow)
            for s in wf.streams:
                state, position = st.lock_stream(conn, s.id)
                if s.slot_name == slot and position is not None and state != st.ERROR:
                    st.set_state(conn, s.id, st.ERROR, f"{note}; {cluster.way_out(sink)}")
    except Exception as exc:  # noqa: BLE001
        log.info("could not record the release on sink %s (%s): %s", sink, describe(cluster.sinks[sink]), exc)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
