"""What vacuum keeps for a vdiff comparing beside the driver: its point's position and each table's version.

A vdiff writes its pin (LakeWorkflow.pins, by vdiff id) once it read the versions at its point, and removes
it when the comparison ends, also on failure. A killed vdiff's pin stays: it expires after PIN_SECONDS.
"""

from __future__ import annotations

import time

from .state import update_retrying

PIN_SECONDS = 6 * 3600.0  # a pin older than this no longer keeps its point against vacuum


def add(store, name: str, pin_id: str, position: int, versions: dict[str, int]) -> None:
    def change(w) -> None:
        w.pins[pin_id] = {"position": position, "versions": dict(versions), "at": time.time()}

    update_retrying(store, name, change)


def remove(store, name: str, pin_id: str) -> None:
    def change(w) -> None:
        w.pins.pop(pin_id, None)

    update_retrying(store, name, change)


def pinned(pins: dict, now: float | None = None) -> tuple[set[int], dict[str, set[int]]]:
    """What vacuum must keep for unexpired pins: their points' positions, each table's versions."""
    now = time.time() if now is None else now
    positions, versions = set(), {}
    for pin in pins.values():
        if now - float(pin.get("at") or 0) > PIN_SECONDS:
            continue
        positions.add(int(pin["position"]))
        for table, v in (pin.get("versions") or {}).items():
            versions.setdefault(table, set()).add(int(v))
    return positions, versions
