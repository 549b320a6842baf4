"""The PostgreSQL applier's staging rows as COPY text (appliers/postgres.copy_text), golden."""

from __future__ import annotations

from sluicegate.appliers.postgres import copy_text
from sluicegate.postgres.pgoutput import UNCHANGED


def render(rows, ncols):
    out = []
    deletes = copy_text(rows, ncols, out.append)
    return "".join(out), deletes


def test_plain_rows_are_joined_as_they_are():
    text, deletes = render([("U", ("1", "a b", "-5"), None), ("D", ("2", None, None), None)], 3)
    assert text == "U\t\\N\t1\ta b\t-5\nD\t\\N\t2\t\\N\t\\N\n"
    assert deletes == 1


def test_values_that_need_escaping():
    rows = [("U", ("1", "tab\there", "line\nbreak", "back\\slash", "cr\rx"), None)]
    text, _ = render(rows, 5)
    assert text == "U\t\\N\t1\ttab\\there\tline\\nbreak\tback\\\\slash\tcr\\rx\n"


def test_null_unchanged_and_kept_columns():
    text, deletes = render([("U", ("7", UNCHANGED, None, "x"), [1, 2])], 4)
    assert text == "U\t{1,2}\t7\t\\N\t\\N\tx\n" and deletes == 0


def test_many_rows_are_written_in_blocks():
    rows = [("U", (str(i), "v"), None) for i in range(2500)]
    out = []
    copy_text(rows, 2, out.append)
    assert len(out) == 3 and "".join(out).count("\n") == 2500
    assert "".join(out).splitlines()[2499] == "U\t\\N\t2499\tv"
