"""`sluicegate check KIND` takes exactly the flags of `KIND create` (plus --json), and prints one line per
problem; create's refusal lists every privilege error at once."""

from __future__ import annotations

import pytest

from sluicegate.cli.main import cli
from sluicegate.errors import UsageError
from sluicegate.postgres import needs
from sluicegate.preflight.report import Problem, refuse


@pytest.mark.parametrize("kind", ["movetables", "materialize", "reshard", "replicate"])
def test_check_takes_the_flags_of_create(kind):
    create = cli.commands[kind].commands["create"]
    check = cli.commands["check"].commands[kind]
    flags = lambda cmd: {o for p in cmd.params for o in p.opts}
    assert flags(check) == flags(create) | {"--json"}
    assert not next(p for p in check.params if p.name == "name").required


def test_a_problem_is_one_line_with_its_fix():
    p = Problem("source h:5432/db", "user u may not create replication slots", "ALTER ROLE u REPLICATION")
    assert p.line() == "error: source h:5432/db: user u may not create replication slots — fix: ALTER ROLE u REPLICATION"
    s = Problem("target h:1/db", "wal_level = replica", "ALTER SYSTEM SET wal_level = logical", restart=True,
                area="setting")
    assert s.line().endswith("(then restart the server)") and "\n" not in s.line()


def test_create_refuses_every_privilege_error_at_once_and_nothing_else():
    problems = [Problem("sink b", "may not execute f1", "GRANT EXECUTE ON FUNCTION f1() TO u"),
                Problem("sink b", "may not SET p", "GRANT SET ON PARAMETER p TO u"),
                Problem("sink b", "max_slot_wal_keep_size = -1", severity="warning", area="setting"),
                Problem("sink b", "wal_level = replica", area="setting")]
    with pytest.raises(UsageError) as refused:
        refuse(problems)
    text = str(refused.value)
    assert "2 thing(s)" in text and "f1()" in text and "SET ON PARAMETER p" in text and "wal_level" not in text
    refuse(problems[2:])  # settings are create's own checks; warnings never refuse


def test_every_need_has_a_use_and_a_reason():
    for n in needs.NEEDS:
        assert n.kind in ("function", "parameter", "role") and n.uses and n.why
    assert set(needs.names("parameter", {needs.REPLICA_ROLE})) == {"session_replication_role"}
