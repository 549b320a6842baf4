"""Positions are source LSNs: ints inside Sluicegate, `0/16B3748` when printed or stored as pg_lsn."""

from __future__ import annotations


def parse_lsn(text: str) -> int:
    """'16/B374D848' -> int. Raises ValueError naming the bad text."""
    try:
        hi, lo = text.strip().split("/")
        return (int(hi, 16) << 32) | int(lo, 16)
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"not a position (LSN like 0/16B3748): {text!r}") from exc


def format_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
