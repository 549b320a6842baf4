"""Shards as key ranges in Vitess notation over a hash of a sharding column (pure).

A row's keyspace id is the first 8 bytes of md5 of its sharding column's PostgreSQL text — a hash both
Spark (`md5`) and PostgreSQL (`md5`) compute the same way from the same text, so the copy, the stream and a
check in SQL agree on which shard holds a row. A shard named `-80` holds keyspace ids below 0x80…,
`80-` those from 0x80… up, `40-80` those in between; `-` is the whole keyspace.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from ..errors import UsageError

WIDTH = 16  # hex digits of a keyspace id: 8 bytes
_NAME = re.compile(r"([0-9a-f]*)-([0-9a-f]*)")


@dataclass(frozen=True, order=True)
class KeyRange:
    lo: str  # inclusive, WIDTH hex digits; '' is the start of the keyspace
    hi: str  # exclusive; '' is the end

    @classmethod
    def parse(cls, name: str) -> KeyRange:
        m = _NAME.fullmatch(name.strip().lower())
        if not m:
            raise UsageError(f"shard {name!r} is not a key range like -80, 80- or 40-80 (hex, Vitess notation)")
        lo, hi = (b.ljust(WIDTH, "0") if b else "" for b in m.groups())
        if len(lo) > WIDTH or len(hi) > WIDTH:
            raise UsageError(f"shard {name!r}: a bound has at most {WIDTH} hex digits")
        if lo and hi and lo >= hi:
            raise UsageError(f"shard {name!r}: its start is not below its end")
        return cls(lo, hi)

    def overlaps(self, other: KeyRange) -> bool:
        return (not self.hi or not other.lo or other.lo < self.hi) and (not other.hi or not self.lo or self.lo < other.hi)

    def intersect(self, other: KeyRange) -> KeyRange:
        lo = max(self.lo, other.lo)
        his = [h for h in (self.hi, other.hi) if h]
        return KeyRange(lo, min(his) if his else "")

    def contains(self, keyspace_id: str) -> bool:
        return (not self.lo or keyspace_id >= self.lo) and (not self.hi or keyspace_id < self.hi)

    def spark_filter(self, column: str) -> str:
        """Spark SQL keeping rows of this range, `column` holding the sharding column's text."""
        kid = f"substr(md5({column}), 1, {WIDTH})"
        parts = [f"{kid} >= '{self.lo}'"] if self.lo else []
        parts += [f"{kid} < '{self.hi}'"] if self.hi else []
        return " AND ".join(parts) or "true"

    def pg_filter(self, column: str):
        """The same test in PostgreSQL over a column (its text is what the source's text was)."""
        from psycopg import sql

        kid = sql.SQL("substr(md5({}::text), 1, {})").format(sql.Identifier(column), sql.Literal(WIDTH))
        parts = [sql.SQL("{} >= {}").format(kid, sql.Literal(self.lo))] if self.lo else []
        parts += [sql.SQL("{} < {}").format(kid, sql.Literal(self.hi))] if self.hi else []
        return sql.SQL(" AND ").join(parts) if parts else sql.SQL("true")

    def __str__(self) -> str:
        return "-".join(re.sub(r"(00)+$", "", bound) for bound in (self.lo, self.hi))  # Vitess' short names


def keyspace_id(text: str) -> str:
    return hashlib.md5(text.encode()).hexdigest()[:WIDTH]


def check_partition(kind: str, names: list[str]) -> list[KeyRange]:
    """The shards of one side cover the keyspace exactly once: no gap, no overlap."""
    ranges = sorted((KeyRange.parse(n), n) for n in names)
    if not ranges:
        raise UsageError(f"name at least one {kind} shard")
    edge = ""
    for r, name in ranges:
        if r.lo != edge:
            what = "leaves a gap before it" if r.lo > edge else "overlaps the one before it"
            raise UsageError(f"{kind} shards must cover the keyspace once: {name} {what}")
        edge = r.hi or None  # None: the keyspace's end is covered
    if edge is not None:
        raise UsageError(f"{kind} shards must cover the keyspace once: nothing covers keyspace ids from {edge} up")
    return [KeyRange.parse(n) for n in names]
