"""Point requests: a vdiff asks the running driver of a Delta workflow for a consistent point at a position.

A request lives in the workflow's state document (`LakeWorkflow.point_requests`, keyed by request id), so it
goes through `store.update` on a local Store and on a DeltaStore alike (different ids, and different fields of
one id, never clash in DeltaStore's three-way merge). Its life (lake/vdiff.py's docstring says why):

  {"position": None, "held_at": None}   the vdiff's hold: the driver, at its next batch boundary, writes its
                                        position into held_at and plays no further while the hold lasts
  {"position": P, "held_at": A}         the vdiff's snapshot is at P >= A: the driver plays to exactly P,
                                        records a point there (even when nothing merged) and sets done
  {..., "done": True, "versions": {..}} each table's newest version once the driver is at P (read again,
                                        so a write by another writer counts, as for a vdiff without driver;
                                        the log's point at P may predate it); the vdiff compares at these,
                                        and vacuum keeps them and the point meanwhile
  (removed)                             by the vdiff, when the comparison is over (or failed)

A killed vdiff leaves its request behind: a hold lapses after HOLD_SECONDS (the driver goes on), any request
after REQUEST_SECONDS (vacuum stops keeping its point).
"""

from __future__ import annotations

import time
import uuid

HOLD_SECONDS = 30.0  # a hold not turned into a position by then is a killed vdiff's: the driver goes on
REQUEST_SECONDS = 6 * 3600.0  # a request older than this no longer pins its point against vacuum
HELD = -1  # serve(): the driver must not play now


def new_request() -> tuple[str, dict]:
    return uuid.uuid4().hex[:12], {"position": None, "held_at": None, "done": False, "missed": "",
                                   "at": time.time()}


def live(requests: dict, now: float | None = None) -> dict:
    """The requests a driver still serves: holds younger than HOLD_SECONDS, positioned ones not expired."""
    now = time.time() if now is None else now
    out = {}
    for rid, r in requests.items():
        age = now - float(r.get("at") or 0)
        if age > REQUEST_SECONDS or (r.get("position") is None and age > HOLD_SECONDS):
            continue
        out[rid] = r
    return out


def pinned(requests: dict, now: float | None = None) -> tuple[set[int], dict[str, set[int]]]:
    """What vacuum must keep for live requests: the positions of their points, each table's versions."""
    positions, versions = set(), {}
    for r in live(requests, now).values():
        if r.get("position") is not None:
            positions.add(int(r["position"]))
        for table, v in (r.get("versions") or {}).items():
            versions.setdefault(table, set()).add(int(v))
    return positions, versions


def serve(store, wf, position: int, record_point) -> int | None:
    """The driver, at a batch boundary at `position` (the state's): acknowledge new holds, answer requests
    at `position` (record_point() records a point there and returns the tables' versions), give up on those
    behind it. Returns HELD (play nothing now), the next requested position to stop a batch at, or None
    (play as usual)."""
    requests = live(wf.point_requests)
    if not requests:
        return None
    ack = [rid for rid, r in requests.items() if r.get("position") is None and r.get("held_at") is None]
    here = [rid for rid, r in requests.items() if r.get("position") == position and not r.get("done")]
    behind = [rid for rid, r in requests.items()
              if r.get("position") is not None and r["position"] < position and not r.get("done")
              and not r.get("missed")]
    versions = record_point() if here else None
    if ack or here or behind:
        with store.update(wf.name) as w:
            for rid in ack:
                if rid in w.point_requests:
                    w.point_requests[rid]["held_at"] = position
            for rid in here:
                if rid in w.point_requests:
                    w.point_requests[rid].update(done=True, versions=versions)
            for rid in behind:
                if rid in w.point_requests:
                    w.point_requests[rid]["missed"] = f"the driver was already at {position}"
    if any(r.get("position") is None for r in requests.values()):
        return HELD
    ahead = [int(r["position"]) for r in requests.values() if r.get("position") is not None
             and r["position"] > position]
    return min(ahead) if ahead else None


def mark_done(w, position: int, versions: dict[str, int]) -> None:
    """In the driver's state update of a batch ending at `position`: the requests for it are answered."""
    for r in w.point_requests.values():
        if r.get("position") == position:
            r.update(done=True, versions=versions)
