"""Housekeeping of a Delta target: compaction of small files (optimize) and removal of unneeded files (vacuum).

Each replicated batch is one small commit per table: files pile up. `optimize` rewrites them into few large ones
(a new version, same rows; the app transaction versions that make batches exactly once carry over). `vacuum`
deletes files no kept version needs: files removed by versions older than the retention, and files no version
ever added (a killed writer's), once older than the retention too (a running writer's files are not in the log
until it commits). Every version a kept point of the consistent-read log names stays readable; points older
than the retention (but never the newest) are dropped from the log first, so no reader is offered them.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

from ...errors import RetryableError, UsageError
from . import durable, pins, read
from .location import filesystem_paths
from .state import app_id, open_store

SHORT_RETENTION = timedelta(hours=1)  # below this a running writer's not yet committed files are at risk


def _table(uri: str, storage_options=None):
    dt = read._open(uri, storage_options=storage_options)
    if dt is None:
        raise UsageError(f"{uri} is not a Delta table, though the workflow's newest point names it: was it "
                         f"deleted? `sluicegate workflow status` tells what the workflow holds")
    return dt


def _commit_failed(uri: str, what: str, exc: Exception) -> RetryableError:
    return RetryableError(f"{uri}: {what} lost a race with a concurrent commit ({type(exc).__name__}); "
                          f"run it again")


def optimize(path: str, workflow: str, *, target_size: int | None = None, storage_options=None) -> dict:
    """Compact each of the workflow's tables (and the points table). A report: per table its files and version
    before and after, and its app transaction version (checked not to go back)."""
    from deltalake.exceptions import CommitFailedError

    report = {"workflow": workflow, "path": read.lake_path(path), "tables": []}
    tables = sorted(read.point_for(path, workflow, storage_options=storage_options).versions)
    for name, uri in [*((t, read.table_uri(path, t)) for t in tables), ("(points)", read.points_uri(path))]:
        dt = _table(uri, storage_options)
        before = {"files": len(dt.file_uris()), "version": dt.version(),
                  "transaction": dt.transaction_version(app_id(workflow))}
        try:
            metrics = dt.optimize.compact(target_size=target_size)
        except CommitFailedError as exc:
            raise _commit_failed(uri, "optimize", exc) from None
        dt.update_incremental()
        durable.sync_versions(dt.table_uri, before["version"], dt.version())  # its new files replace old ones
        after = {"files": len(dt.file_uris()), "version": dt.version(),
                 "transaction": dt.transaction_version(app_id(workflow))}
        if before["transaction"] is not None and (after["transaction"] or -1) < before["transaction"]:
            # delta-rs keeps app transactions through compaction; should it stop, exactly once would break.
            raise RetryableError(f"{uri}: optimize lost the app transaction {app_id(workflow)} "
                                 f"({before['transaction']} -> {after['transaction']}): do not run the workflow "
                                 f"until it is set again; report this as a bug")
        report["tables"].append({"table": name, "files_before": before["files"], "files_after": after["files"],
                                 "version_before": before["version"], "version_after": after["version"],
                                 "transaction_version": after["transaction"],
                                 "files_added": metrics.get("numFilesAdded", 0),
                                 "files_removed": metrics.get("numFilesRemoved", 0)})
    return report


def _kept_points(points: list[read.Point], cutoff: datetime) -> list[read.Point]:
    """The newest point, and every point whose source commit time is at or after `cutoff`. A point without a
    commit time (the copy's) is no later than the next point with one: it goes when that one is too old."""
    kept = []
    bound = None  # the oldest commit time among newer points: an upper bound for points without one
    for i, point in enumerate(reversed(points)):
        when = point.committed_at or bound
        if i == 0 or when is None or when >= cutoff:
            kept.append(point)
        if point.committed_at is not None:
            bound = point.committed_at if bound is None else min(bound, point.committed_at)
    return kept[::-1]


def vacuum(path: str, workflow: str, retention: timedelta, *, dry_run: bool = False, allow_short: bool = False,
           now: datetime | None = None, storage_options=None) -> dict:
    """Drop points older than `retention` (never the newest), then delete from each of the workflow's tables
    (and the points table) the files no version within the retention and no kept point needs, and the files no
    version ever added, older than the retention. A report of what went (or would go, when `dry_run`)."""
    from deltalake.exceptions import CommitFailedError

    if retention < timedelta(0):
        raise UsageError(f"retention {retention} is negative: give a duration such as 7d")
    if retention < SHORT_RETENTION and not allow_short:
        raise UsageError(f"retention {retention} is under {SHORT_RETENTION}: the files of a commit a running "
                         f"writer is making would go too; allow it only when nothing writes to the target "
                         f"(--allow-short-retention)")
    now = now or datetime.now(timezone.utc)
    cutoff = now - retention
    # delta-rs takes whole hours. Rounded up, unless short retentions are allowed (nothing else writes):
    # rounded down, since the kept points' versions are kept by name (keep_versions) whatever their age, and
    # an hour of a busy table's old versions is many times its size (bench/README.md, "Issue 34: lake size").
    hours = (math.floor if allow_short else math.ceil)(retention.total_seconds() / 3600)

    # Read before the points: a vdiff pins its point's position before the point is recorded (pins.py). A
    # lake whose workflow state went has no vdiff running on it.
    store = open_store(path)
    pinned, pinned_versions = (pins.pinned(store.load(workflow).pins) if store.exists(workflow)
                               else (set(), {}))
    all_points = read.points(path, workflow, storage_options)
    if not all_points:
        read.point_for(path, workflow, storage_options=storage_options)  # the error saying why
    oldest = _kept_points(all_points, cutoff)[0].position
    # What the log holds once older ones are gone; a point a running vdiff compares at stays, however old.
    kept = [p for p in all_points if p.position >= oldest or p.position in pinned]
    dropped = len(all_points) - len(kept)
    points_uri = read.points_uri(path)
    if dropped and not dry_run:
        pts = _table(points_uri, storage_options)
        spared = "".join(f" AND position <> {int(p)}" for p in sorted(pinned) if p < oldest)
        quoted = workflow.replace("'", "''")
        try:
            pts.delete(f"workflow = '{quoted}' AND position < {oldest}{spared}")
        except CommitFailedError as exc:
            raise _commit_failed(points_uri, "dropping old points", exc) from None

    report = {"workflow": workflow, "path": read.lake_path(path), "retention_hours": hours, "dry_run": dry_run,
              "points_dropped": dropped, "points_kept": len(kept),
              "oldest_kept_point": kept[0].position_text, "tables": []}
    for name in sorted(kept[-1].versions):
        keep = {p.versions[name] for p in kept if name in p.versions}
        keep = sorted(keep | pinned_versions.get(name, set()))
        report["tables"].append(_vacuum_one(name, read.table_uri(path, name), hours, keep, dry_run,
                                            storage_options))
    # Readers read the points table's newest version only: no version of it needs keeping.
    report["tables"].append(_vacuum_one("(points)", points_uri, hours, [], dry_run, storage_options))
    return report


def _vacuum_one(name, uri, hours, keep, dry_run, storage_options) -> dict:
    dt = _table(uri, storage_options)
    # full=True: also files the log never mentions (a killed writer's); without it delta-rs leaves them.
    args = {"retention_hours": hours, "enforce_retention_duration": False, "full": True,
            "keep_versions": keep or None}
    # Sized before they go: a dry run's list (a real run removes the same files, or fewer if a commit came).
    listed = dt.vacuum(dry_run=True, **args)
    sizes = _sizes(uri, listed)
    removed = listed if dry_run else dt.vacuum(dry_run=False, **args)
    return {"table": name, "files_removed": len(removed), "bytes_removed": sum(sizes.get(f, 0) for f in removed),
            "removed": sorted(removed), "kept_versions": keep}


def _sizes(uri: str, files: list[str]) -> dict[str, int]:
    """{file as vacuum names it (relative to the table): its size in bytes} (0 when it is gone meanwhile)."""
    if not files:
        return {}
    fs, paths = filesystem_paths([f if "://" in f or f.startswith("/") else f"{uri}/{f}" for f in files])
    return {f: max(info.size or 0, 0) for f, info in zip(files, fs.get_file_info(paths))}


def _size(n: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def format_vacuum(report: dict, verbose: bool = False) -> list[str]:
    """`lake vacuum`'s lines: the points, one line per table (files, bytes), the total; with `verbose`, each
    table's kept versions and files removed too."""
    dry = report["dry_run"]
    verb, drop = ("would remove", "would drop") if dry else ("removed", "dropped")
    points = (f"points: {drop} {report['points_dropped']} older than the retention, kept {report['points_kept']} "
              f"(oldest {report['oldest_kept_point']})")
    lines = [points]
    for t in report["tables"]:
        kept = t["kept_versions"]
        kept_text = f"; keeps {len(kept)} version{'s' if len(kept) != 1 else ''} of kept points" if kept else ""
        lines.append(f"{t['table']}: {verb} {t['files_removed']} files, {_size(t['bytes_removed'])}{kept_text}")
        if verbose:
            if kept:
                lines.append(f"  kept versions: {', '.join(map(str, kept))}")
            lines += [f"  {f}" for f in t["removed"]]
    files = sum(t["files_removed"] for t in report["tables"])
    size = sum(t["bytes_removed"] for t in report["tables"])
    lines.append(f"total: {verb} {files} files, {_size(size)}" + ("" if verbose or not files else
                                                                    " (-v lists them)"))
    return lines
