"""Golden files: each case under tests/unit/golden/<area>/ holds its input and the expected output side by side.

A case is a text file in three parts (cf. sqlglot's fixtures):

    # free text: what the case is about (lines before the first marker)
    -- input
    { JSON: what the area's function takes }
    -- expected
    what it must produce, as text

Areas: `applier` (the PostgreSQL applier's statements for a table, appliers/postgres.py and keyless.py),
`lww` (last-writer-wins statements, appliers/lww.py), `rules` (a rule's Spark SQL, rules/spec.py and
compile.py: the parts that need no Spark analyzer), `status` (`workflow status --json` from state objects,
workflow/status.py). Statements are rendered from psycopg.sql without a connection. Pure: no server, no Spark.

To add a case, write its `-- input` and an empty `-- expected`, then regenerate:

    SLUICEGATE_GOLDEN_UPDATE=1 ./scripts/test tests/unit/test_golden.py

which rewrites every case's expected part with what the code produces now (and passes). Read the diff
before committing it: an expected output is what the code should produce, not merely what it did.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
from psycopg import sql

from sluicegate.appliers import keyless, lww
from sluicegate.appliers import postgres as pg_applier
from sluicegate.errors import SluicegateError
from sluicegate.postgres.catalog import Column, Table
from sluicegate.rules.compile import CompiledRule
from sluicegate.rules.evaluate import RAW_VIEW
from sluicegate.rules.spec import parse_rule
from sluicegate.workflow import state as st
from sluicegate.workflow.status import merge_status, workflow_status

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("SLUICEGATE_GOLDEN_UPDATE") == "1"
INPUT, EXPECTED = "-- input\n", "-- expected\n"


def parse_case(text: str) -> tuple[str, str, str]:
    """(description, input as written, expected) of a case file."""
    head, sep, rest = text.partition(INPUT)
    body, sep2, expected = rest.partition(EXPECTED)
    assert sep and sep2, "a case needs an `-- input` and an `-- expected` line"
    return head, body, expected


def render(statement) -> str:
    """A statement as text: a psycopg.sql Composable (quoted without a connection), a (head, tail) pair as
    run without a key range between them, a bool, or nothing."""
    if statement is None:
        return "(none)"
    if isinstance(statement, bool):
        return str(statement).lower()
    if isinstance(statement, tuple):
        statement = statement[0] + statement[1]
    if isinstance(statement, sql.Composable):
        return statement.as_string(None)
    return str(statement)


def sections(items) -> str:
    return "".join(f"[{name}]\n{render(value)}\n" for name, value in items)


def table_of(d: dict) -> Table:
    return Table.from_json({"schema": "public", **d})


# -- the areas: input -> text ---------------------------------------------------------------------------------
def applier(case: dict) -> str:
    table = table_of(case["table"])
    stage = sql.Identifier(case.get("stage", "sg_stage_0"))
    if table.keyless:
        return sections(keyless.compose_plan(table, stage, always=case.get("always", False)).items())
    staged = None
    if case.get("create", True):
        staged = pg_applier.staged_columns_of(table, case.get("domain_bases", {}))
    plan = pg_applier.compose_plan(table, stage, mode=case.get("mode", "all"), lastpk=case.get("lastpk"),
                                   staged=staged, unique=case.get("unique", False),
                                   always=case.get("always", False), referenced=case.get("referenced", False))
    return sections(plan.items())


def lww_plan(case: dict) -> str:
    table = table_of(case["table"])
    local = case["local_cluster"]
    origins = {lww.LOCAL_ORIGIN: local, **{int(k): v for k, v in case.get("origins", {}).items()}}
    plan = lww.compose_plan(table, sql.Identifier(case.get("stage", "sg_lww_0")), local_cluster=local,
                            origins=origins, upto=case.get("upto"),
                            staged=pg_applier.staged_columns_of(table, case.get("domain_bases", {})),
                            always=case.get("always", False))
    return sections(plan.items())


def rules(case: dict) -> str:
    try:
        spec = parse_rule(case["rule"])
    except SluicegateError as exc:
        return sections([("error", f"{type(exc).__name__}: {exc}")])
    source = table_of(case["source"])
    # What Spark's analyzer would find (compile_rule): per target column ["raw", source index, name] or
    # ["expr", name]; by default every source column passed through.
    found = case.get("outputs") or [["raw", i, c.name] for i, c in enumerate(source.columns)]
    outputs = tuple((o[0], o[1]) for o in found)
    target = Table(source.schema, spec.target, tuple(
        replace(source.columns[o[1]], name=o[2]) if o[0] == "raw" else Column(o[1], "text", 25, False, None)
        for o in found), source.key)
    rule = CompiledRule(spec.to_text(), source, target, spec.select, case.get("view", spec.target), outputs, (),
                        filtered=case.get("filtered", False))
    if "keyrange" in case:
        rule = rule.with_keyrange(*case["keyrange"])
    out = [("target", spec.target), ("pattern", spec.is_pattern), ("moves only", rule.moves_only),
           ("typed view (copy)", rule.typed_view_sql(RAW_VIEW)),
           ("runtime select", rule.runtime_select)]
    if "extra" in case or rule.keyrange is not None:
        out.append(("typed view (changes)", rule.typed_view_sql(RAW_VIEW, case.get("extra", []), in_range=False)))
    if rule.keyrange is not None:
        out.append(("target key range", rule.target_keyrange()))
    return sections(out)


def _when(v: str | None) -> datetime | None:
    return datetime.fromisoformat(v) if v is not None else None


def _workflow(d: dict) -> st.Workflow:
    streams = []
    for s in d["streams"]:
        tables = [st.TableState(table_of(t["table"]), t.get("lastpk"), t.get("rows_copied", 0), t.get("done", False))
                  for t in s.get("tables", [])]
        streams.append(st.Stream(s["id"], d["name"], s.get("source_shard", "-"), s.get("source_url", d["source_url"]),
                                 s.get("slot_name", f"sg_{d['name']}"), f"sg_{d['name']}", s["state"],
                                 s.get("message", ""), s.get("position"), _when(s.get("caught_up_at")),
                                 _when(s.get("transaction_time")), _when(s["updated_at"]), tables))
    return st.Workflow(d["name"], d.get("kind", "MoveTables"), d["source_url"], d.get("options", {}), streams,
                       st.Driver(*d.get("driver", [None, None, None])))


def status(case: dict) -> str:
    now = _when(case["now"])
    parts = []
    for shard, wf in case.get("parts") or [["-", case["workflow"]]]:
        slots = {int(k): v for k, v in wf.get("slots", {}).items()} if "slots" in wf else None
        kwargs = {"wal_warning": wf["wal_warning"]} if "wal_warning" in wf else {}
        parts.append((shard, workflow_status(_workflow(wf), now, slots, **kwargs)))
    return json.dumps(merge_status(parts), indent=2) + "\n"


AREAS = {"applier": applier, "lww": lww_plan, "rules": rules, "status": status}
CASES = sorted(GOLDEN.glob("*/*.case"))


def test_every_area_has_cases():
    assert {p.parent.name for p in CASES} == set(AREAS)


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_golden(path: Path):
    head, body, expected = parse_case(path.read_text())
    got = AREAS[path.parent.name](json.loads(body))
    if UPDATE:
        if got != expected:
            path.write_text(f"{head}{INPUT}{body}{EXPECTED}{got}")
        return
    assert got == expected, f"{path.relative_to(GOLDEN)}: see SLUICEGATE_GOLDEN_UPDATE in this module's docstring"
