"""The PostgreSQL applier's staging rows as COPY text (appliers/postgres.copy_text), golden, in C and in
Python."""

from __future__ import annotations

import pytest

from sluicegate.appliers import postgres
from sluicegate.appliers.postgres import copy_text
from sluicegate.postgres.pgoutput import UNCHANGED

from .accelerated import c_or_python


@pytest.fixture(autouse=True, params=["c", "python"])
def mode(request, monkeypatch):
    return c_or_python(request, monkeypatch, postgres, "_copy_lines_c")


def text_of(out: list) -> str:
    return "".join(x.decode() if isinstance(x, bytes) else x for x in out)


def render(rows, ncols):
    out = []
    deletes = copy_text(rows, ncols, out.append)
    return text_of(out), deletes


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
    assert len(out) == 3 and text_of(out).count("\n") == 2500
    assert text_of(out).splitlines()[2499] == "U\t\\N\t2499\tv"


def test_non_ascii_text_and_a_row_of_another_shape():
    """UTF-8 passes through as it is; a row the C version does not take (here `keep` as a tuple) sends its
    block to the Python version, with the same text."""
    rows = [("U", ("1", "é ☃ \u00a0", "x\\y"), None), ("U", ("2", None, "z"), (1,)),
            ("D", ("3", "", ""), None)]
    text, deletes = render(rows, 3)
    assert text == "U\t\\N\t1\té ☃ \u00a0\tx\\\\y\nU\t{1}\t2\t\\N\tz\nD\t\\N\t3\t\t\n"
    assert deletes == 1
