"""The transaction assembler over recorded pgoutput bytes (no server)."""

from __future__ import annotations

import pytest

from sluicegate.position import format_lsn, parse_lsn
from sluicegate.postgres.assembler import Change, Framing, TruncateChange, assemble
from sluicegate.postgres.pgoutput import Begin, Commit, DecodeError

from . import recordings


def recorded(name: str = "pg15_text") -> list[tuple[int, bytes]]:
    return [(r["lsn"], bytes.fromhex(r["data"])) for r in recordings.read(name)[1]]


@pytest.mark.parametrize("name", recordings.NAMES)
def test_transactions_are_framed_and_changes_resolved(name):
    events = list(assemble(recorded(name)))
    begins = [e for e in events if isinstance(e, Begin)]
    commits = [e for e in events if isinstance(e, Commit)]
    assert begins and len(begins) == len(commits)
    depth = 0
    for e in events:
        if isinstance(e, Begin):
            depth += 1
        elif isinstance(e, Commit):
            depth -= 1
        else:
            assert depth == 1, "every change sits inside a transaction"
        assert depth in (0, 1)
    # commit positions only grow: the order positions rely on
    ends = [c.end_lsn for c in commits]
    assert ends == sorted(ends) and all(c.end_lsn > c.commit_lsn for c in commits)
    changes = [e for e in events if isinstance(e, Change)]
    assert {c.kind for c in changes} == {"I", "U", "D"}
    assert all(c.relation.name for c in changes)
    assert any(isinstance(e, TruncateChange) and len(e.relations) == 2 for e in events)
    # a key-changing update carries the old key
    assert any(c.kind == "U" and c.old is not None for c in changes)


def test_relation_cache_carries_across_calls():
    rows = recorded()
    cache = Framing()
    first_commit = next(i for i, (_, d) in enumerate(rows) if d[:1] == b"C")
    list(assemble(rows[: first_commit + 1], cache))
    assert cache.relations, "Relation messages were remembered"
    # the rest decodes with the cache even where its Relation came in the first part
    list(assemble(rows[first_commit + 1:], cache))


def test_broken_framing_is_an_error():
    rows = recorded()
    first_commit = next(i for i, (_, d) in enumerate(rows) if d[:1] == b"C")
    with pytest.raises(DecodeError, match="cut off"):
        list(assemble(rows[:first_commit]))
    change = next(i for i, (_, d) in enumerate(rows) if d[:1] == b"I")
    with pytest.raises(DecodeError):
        list(assemble(rows[change:change + 1], Framing()))


@pytest.mark.parametrize("text,value", [("0/0", 0), ("0/16B3748", 0x16B3748), ("1A/FF", (0x1A << 32) | 0xFF)])
def test_positions_round_trip(text, value):
    assert parse_lsn(text) == value
    assert format_lsn(value) == text


def test_bad_position_names_the_text():
    with pytest.raises(ValueError, match="16B3748"):
        parse_lsn("16B3748")


def test_origin_is_yielded_only_when_asked():
    """A transaction a replication origin wrote: its Origin message comes right after Begin (PostgreSQL 14/15),
    and a bidirectional capture skips the transaction by it."""
    import struct

    from sluicegate.postgres.pgoutput import Origin

    begin = b"B" + struct.pack(">QqI", 0x3000, 0, 7)
    origin = b"O" + struct.pack(">Q", 0x1234) + b"sg_abc_from_a\0"
    commit = b"C" + struct.pack(">BQQq", 0, 0x3000, 0x3028, 0)
    raw = [(0x2000, begin), (0x2000, origin), (0x3000, commit)]
    events = list(assemble(raw, origins=True))
    assert [type(e) for e in events] == [Begin, Origin, Commit]
    assert events[1] == Origin(0x1234, "sg_abc_from_a")
    assert [type(e) for e in assemble(raw)] == [Begin, Commit]
