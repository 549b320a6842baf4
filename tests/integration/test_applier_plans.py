"""The PostgreSQL applier's table plans kept across the transactions of a play task (appliers/plans.py), on a
real target: many transactions, each a new applier as the player makes them, reuse one plan and staging table;
a change of the table's shape or facts (through the applier's paths, or made on the target behind its back)
and a rolled-back transaction (its staging table gone) make it again, and the target always ends up equal to
what was applied."""

from __future__ import annotations

import psycopg
import pytest

from sluicegate.appliers.plans import TablePlans
from sluicegate.appliers.postgres import PostgresApplier, TargetTable
from sluicegate.postgres.catalog import describe_table


class Stream:
    """Transactions applied as the player applies batches: a new applier each, the plans kept. `model`: what
    the target must hold (key -> row), by what was committed."""

    def __init__(self, conn: psycopg.Connection):
        self.conn, self.plans = conn, TablePlans()
        self.table = describe_table(conn, "public", "t")
        self.model: dict[str, tuple] = {}

    def batch(self, puts: list[tuple[str, tuple]], *, fail: str | None = None) -> PostgresApplier:
        """Apply `puts` (op, values) in one transaction; `fail`: a statement run after them that fails, so the
        transaction rolls back."""
        t = TargetTable(self.table)
        applier = PostgresApplier(self.conn, [t], plans=self.plans)
        for op, values in puts:
            applier.put(t, op, (values[0],), values)
        applier.sync()
        if fail is not None:
            with pytest.raises(psycopg.Error):
                self.conn.execute(fail)
            self.conn.rollback()
            return applier
        self.conn.commit()
        for op, values in puts:
            if op == "D":
                self.model.pop(values[0], None)
            else:
                self.model[values[0]] = values
        return applier

    def reshape(self, applier: PostgresApplier, ddl: str) -> None:
        """A replayed statement that changes the table's columns: workflow/ddl_replay.py's order (sync, run, reshape)."""
        applier.sync()
        self.conn.execute(ddl)
        self.table = describe_table(self.conn, "public", "t")
        applier.reshape(("public", "t"), self.table)

    def target(self) -> dict[str, tuple]:
        names = ", ".join(f"{c}::text" for c in self.table.column_names)
        rows = {r[0]: tuple(r) for r in self.conn.execute(f"SELECT {names} FROM t ORDER BY id")}
        self.conn.rollback()  # holds no lock a statement of another session would wait for
        return rows

    def expected(self) -> dict[str, tuple]:
        n = len(self.table.column_names)
        return {k: tuple(v[:n]) + (None,) * (n - len(v)) for k, v in sorted(self.model.items())}


def stages(conn: psycopg.Connection) -> list[str]:
    """The session's temporary tables: the staging tables."""
    names = [r[0] for r in conn.execute(
        "SELECT relname FROM pg_class WHERE relnamespace = pg_my_temp_schema() AND relkind = 'r' ORDER BY 1")]
    conn.rollback()
    return names


def test_plans_kept_across_transactions_and_made_again_when_the_table_changes(pair):
    pair.dst("CREATE TABLE t (id int PRIMARY KEY, code text, v text)")
    with psycopg.connect(pair.target) as conn:
        s = Stream(conn)
        for i in range(3, 43):  # many transactions of inserts, updates and deletes: one plan for all
            k = (i * 7) % 40 + 3
            puts = [("U", (str(i), f"c{i}", "v")), ("U", (str(k), f"c{k}", f"u{i}"))]
            if i % 5 == 0:
                puts.append(("D", (str(i - 3), None, None)))
            s.batch(puts)
        s.batch([("U", ("1", "c1", "v")), ("U", ("2", "c2", "v"))])
        assert s.plans.made == 1
        assert stages(conn) == ["sg_stage_0"]
        assert s.target() == s.expected()

        # A unique index made on the target behind the applier's back (no replayed statement told it): the
        # next transaction's check makes the plan again, so an update that exchanges two codes goes through
        # the delete-and-insert path instead of failing on the index.
        pair.dst("CREATE UNIQUE INDEX t_code ON t (code)")
        s.batch([("U", ("1", "c2", "swapped")), ("U", ("2", "c1", "swapped"))])
        assert s.plans.made == 2
        assert s.target() == s.expected()

        # ADD COLUMN and DROP COLUMN replayed mid-transaction: rows before and after it, both shapes.
        applier = s.batch([("U", ("50", "c50", "before"))])
        s.reshape(applier, "ALTER TABLE t ADD COLUMN extra int")
        t = applier.by_name[("public", "t")]
        applier.put(t, "U", ("51",), ("51", "c51", "after", "7"))
        applier.sync()
        conn.commit()
        s.model["51"] = ("51", "c51", "after", "7")
        assert s.plans.made == 3  # made again for the new shape
        for i in range(60, 70):
            s.batch([("U", (str(i), f"c{i}", "v", str(i)))])
        assert s.plans.made == 3
        assert s.target() == s.expected()

        applier = s.batch([("U", ("70", "c70", "v", "70"))])
        s.reshape(applier, "ALTER TABLE t DROP COLUMN v")
        applier.put(applier.by_name[("public", "t")], "U", ("71",), ("71", "c71", "71"))
        applier.sync()
        conn.commit()
        s.model = {k: (v[0], v[1], v[3] if len(v) > 3 else None) for k, v in s.model.items()}
        s.model["71"] = ("71", "c71", "71")
        s.batch([("U", ("72", "c72", "72")), ("D", ("60", None, None))])
        assert s.plans.made == 4
        assert s.target() == s.expected()
        assert stages(conn) == ["sg_stage_0"]


def test_a_rolled_back_transaction_leaves_no_plan_behind(pair):
    pair.dst("CREATE TABLE t (id int PRIMARY KEY, code text, amount numeric(6,1))")
    with psycopg.connect(pair.target) as conn:
        s = Stream(conn)
        # The first transaction makes the staging table, applies its rows, then fails: all of it rolls back.
        s.batch([("U", ("1", "a", "1.5"))], fail="SELECT 1/0")
        assert stages(conn) == [] and s.target() == {}
        s.batch([("U", ("1", "a", "2.5")), ("U", ("2", "b", "3.5"))])  # made again, not a missing table
        assert s.plans.made == 2
        assert s.target() == s.expected()

        # A column's type changed on the target by another session: the next transaction makes the plan and
        # its staging table again, then fails. The rollback brings the older staging table (numeric(6,1))
        # back; the transaction after it must not stage into it, which would round the values.
        pair.dst("ALTER TABLE t ALTER COLUMN amount TYPE numeric(8,3)")
        s.batch([("U", ("3", "c", "1.234"))], fail="SELECT 1/0")
        assert s.plans.made == 3
        assert stages(conn) == ["sg_stage_0"]
        s.batch([("U", ("3", "c", "2.345")), ("D", ("1", None, None))])
        assert s.plans.made == 4
        assert s.target() == {"2": ("2", "b", "3.500"), "3": ("3", "c", "2.345")}  # not rounded to 2.3
        assert conn.execute("SELECT count(*) FROM pg_temp.sg_stage_0").fetchone()[0] == 0  # emptied by commit
