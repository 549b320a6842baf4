"""The PostgreSQL applier writes a chunk's rows to the target in the key's order, whatever order they came in:
each statement then walks the key's index and the heap forward (bench/README.md, burst with random keys).
Staged keys are unique within a chunk, so the order cannot change what the target ends up holding."""

from __future__ import annotations

import random
import re

import psycopg
import pytest

from sluicegate.appliers.postgres import PostgresApplier, TargetTable
from sluicegate.postgres.catalog import describe_table

# Which row each statement met, in the order it met them: a trigger that fires on the applier's writes.
SETUP = """
CREATE TABLE t (a int, b text COLLATE "C", v text, PRIMARY KEY (a, b));
CREATE TABLE met (n bigserial, op text, a int, b text);
CREATE FUNCTION log_met() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' THEN INSERT INTO met (op, a, b) VALUES (TG_OP, OLD.a, OLD.b); RETURN OLD; END IF;
  INSERT INTO met (op, a, b) VALUES (TG_OP, NEW.a, NEW.b); RETURN NEW;
END $$;
CREATE TRIGGER log_met AFTER INSERT OR UPDATE OR DELETE ON t FOR EACH ROW EXECUTE FUNCTION log_met();
"""


def key(i: int) -> tuple[str, str]:
    # two key columns, the second text: order by (a, b) differs from the order of i
    return str(i % 7), f"k{i:03d}"


def test_a_chunk_meets_the_target_in_key_order(pair):
    pair.dst(SETUP)
    pair.dst("INSERT INTO t SELECT i % 7, 'k' || lpad(i::text, 3, '0'), 'old' FROM generate_series(0, 149) i")
    pair.dst("TRUNCATE met")
    updated, deleted, inserted = range(100), range(100, 150), range(150, 250)
    staged = [("U", i) for i in updated] + [("D", i) for i in deleted] + [("U", i) for i in inserted]
    random.Random(7).shuffle(staged)

    with psycopg.connect(pair.target) as conn:
        t = TargetTable(describe_table(conn, "public", "t"))
        applier = PostgresApplier(conn, [t], chunk_rows=10_000)
        for op, i in staged:
            a, b = key(i)
            applier.put(t, op, (a, b), (a, b, f"new{i}" if op == "U" else None))
        applier.sync()
        conn.commit()

    def met(op: str) -> list[tuple[int, str]]:
        return [tuple(r) for r in pair.dst("SELECT a, b FROM met WHERE op = %s ORDER BY n", (op,))]

    def in_key_order(ids) -> list[tuple[int, str]]:
        return sorted((int(key(i)[0]), key(i)[1]) for i in ids)

    came = [(int(key(i)[0]), key(i)[1]) for op, i in staged if i in updated]
    assert came != in_key_order(updated)  # so the order below is the applier's doing
    assert met("UPDATE") == in_key_order(updated)
    assert met("DELETE") == in_key_order(deleted)
    assert met("INSERT") == in_key_order(inserted)
    expected = sorted((int(key(i)[0]), key(i)[1], f"new{i}") for i in [*updated, *inserted])
    assert [tuple(r) for r in pair.dst("SELECT a, b, v FROM t ORDER BY a, b")] == expected


def test_dense_keys_meet_the_target_by_one_walk_of_the_key_index(pair):
    """A chunk whose integer keys are a dense range is joined with the target by a merge join over that range
    of the key index (appliers/postgres.py dense_range); spread keys keep a search a row. Either way every
    staged row is applied, the range's ends included. The plans are auto_explain's, sent as notices."""
    pair.dst("CREATE TABLE d8 (id bigint PRIMARY KEY, v text)")
    pair.dst("INSERT INTO d8 SELECT i, 'old' FROM generate_series(1, 5000) i")
    with psycopg.connect(pair.target) as conn:
        plans: list[str] = []
        conn.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
        try:
            conn.execute("LOAD 'auto_explain'")
        except psycopg.errors.UndefinedFile:
            pytest.skip("auto_explain is not installed with this server's binaries")
        conn.execute("SET auto_explain.log_min_duration = 0")
        conn.execute("SET auto_explain.log_level = notice")
        t = TargetTable(describe_table(conn, "public", "d8"))
        applier = PostgresApplier(conn, [t], chunk_rows=100_000)

        def chunk(updates, deletes) -> dict[str, str]:
            plans.clear()
            for i in updates:
                applier.put(t, "U", (str(i),), (str(i), f"new{i}"))
            for i in deletes:
                applier.put(t, "D", (str(i),), (str(i), None))
            applier.sync()
            met = {}
            for plan in plans:
                for op in ("Update on", "Delete on", "Insert on"):
                    if op in plan:
                        met[op.split()[0]] = "merge" if re.search(r"Merge (Anti )?Join", plan) else (
                            "search" if "Nested Loop" in plan else plan)
            return met

        # a range updated and one deleted, put out of order: each met by one walk of its range
        dense = chunk(reversed(range(1000, 2000)), range(2999, 1999, -1))
        # the planner's settings are back for the rest of the transaction
        settings = ("enable_nestloop", "enable_hashjoin")
        assert [conn.execute(f"SHOW {name}").fetchone()[0] for name in settings] == ["on", "on"]
        # every other key of a range is still dense
        half = chunk(range(3000, 5000, 2), ())
        # keys spread over the table (some deleted above, so inserted again): a search a row
        spread = chunk(range(1, 5000, 50), range(4999, 4000, -100))
        # a few keys in a row: not worth the planner settings
        few = chunk(range(100, 200), ())
        # rows appended after the last key, and one existing row updated with them: the update meets one
        # row, the insert (of those the target does not have) the rest
        appended = chunk([*range(5001, 6000), 5000], ())
        conn.commit()

    assert dense == {"Update": "merge", "Delete": "merge"}
    assert half == {"Update": "merge"}
    assert spread == {"Update": "search", "Delete": "search", "Insert": "search"}
    assert appended == {"Update": "merge", "Insert": "merge"}
    assert few == {"Update": "search"}
    updated = {*range(1000, 2000), *range(3000, 5000, 2), *range(1, 5000, 50), *range(5000, 6000),
               *range(100, 200)}
    deleted = {*range(2000, 3000), *range(4999, 4000, -100)} - updated
    rows = dict(pair.dst("SELECT id, v FROM d8"))
    assert set(rows) == set(range(1, 6000)) - deleted
    assert {i for i, v in rows.items() if v != "old"} == updated
    assert all(rows[i] == f"new{i}" for i in updated)
