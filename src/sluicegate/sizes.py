"""Byte sizes as people write and read them: '1GB', '512 MB', '1.5GiB' <-> bytes."""

from __future__ import annotations

import re

from .errors import UsageError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in '1GB', '512MB', '10 kB', '1048576' (units of 1024, as PostgreSQL's own settings count)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"size {text!r} not understood: write e.g. 1GB, 512MB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, size in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


_DURATIONS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in '36h', '7d', '90min', '30s', '3600' (seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _DURATIONS:
        raise UsageError(f"duration {text!r} not understood: write e.g. 36h, 7d, 90min or a number of seconds")
    return float(m.group(1)) * _DURATIONS[m.group(2).lower()]
