"""What `check` found: one Problem per missing thing, each with the statement that fixes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class Problem:
    database: str  # the database it concerns, as shown (no password): "source host:5432/shop"
    what: str  # one line: what is missing and what a run does with it
    fix: str = ""  # SQL to run as a superuser on that database, when SQL fixes it
    action: str = ""  # otherwise (or as well): what to do, e.g. edit pg_hba.conf and reload
    restart: bool = False  # the fix takes effect only after a server restart
    severity: str = "error"  # "error": a run fails or loses data; "warning": a run works, with less
    # "privilege" (a grant or role attribute; `create` refuses these too), "setting", "table", "connection"
    area: str = "privilege"

    def line(self) -> str:
        how = "; ".join(x for x in (self.fix and f"fix: {self.fix}", self.action) if x)
        restart = " (then restart the server)" if self.restart else ""
        return f"{self.severity}: {self.database}: {self.what}" + (f" — {how}{restart}" if how else "")

    def to_json(self) -> dict:
        return asdict(self)


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


def refuse(problems: list[Problem]) -> None:
    """`create`'s use of the same checks: refuse what a run would fail on, every such problem at once."""
    bad = [p for p in errors(problems) if p.area == "privilege"]
    if bad:
        raise UsageError(f"a run would fail on {len(bad)} thing(s) (`sluicegate check` lists them): "
                         + " | ".join(p.line().removeprefix("error: ") for p in bad))
