"""`sluicegate check KIND …`: the preflight of a planned workflow (preflight/), with the flags of `KIND create`.

Each subcommand takes exactly the parameters of the create command it checks (made from them, so the two never
drift apart); `--workflow` is optional. Exit status: 0 nothing in the way (warnings may be printed), 1 problems,
2 a usage error."""

from __future__ import annotations

import copy

import click

from .. import targets
from .output import JSON, emit, friendly


def _from_create(create: click.Command, kind: str) -> click.Command:
    params = []
    for p in create.params:
        p = copy.copy(p)
        if p.name == "name":
            p.required = False
        params.append(p)

    def callback(**kw):
        friendly(_check)(kind, kw)

    return JSON(click.Command(kind.lower(), params=params, callback=callback,
                              help=f"Check, as `{kind.lower()} create` would be run, that a {kind} workflow's run "
                                   f"will have what it needs on every database: settings, a replication connection, "
                                   f"privileges, tables. Prints each problem with the SQL that fixes it."))


def _check(kind: str, kw: dict) -> None:
    from ..postgres.catalog import split_list, split_name, with_schemas
    from ..preflight.plan import Plan, check
    from ..preflight.report import errors
    from ..rules.spec import load_rules_file, parse_rules

    def shards(values) -> list[str]:
        return [v.partition("=")[2].strip() for v in values or ()]

    names = split_list(kw["tables"]) if kw.get("tables") else None
    if kw.get("schemas"):
        names = with_schemas(names, split_list(kw["schemas"]))

    plan = Plan(
        kind={"movetables": "MoveTables", "materialize": "Materialize", "reshard": "Reshard",
              "replicate": "Replicate"}[kind],
        sources=[kw["source"]] if kw.get("source") else shards(kw.get("source_shards")),
        targets=[kw["target"]] if kw.get("target") else list(kw.get("sinks") or ()) or shards(kw.get("target_shards")),
        tables=names, exclude=split_list(kw["exclude_tables"]) if kw.get("exclude_tables") else None,
        rules=bool(kw.get("rules") or kw.get("rules_file")) or kind == "materialize",
        bidirectional=bool(kw.get("bidirectional")), workflow=kw.get("name"), on_ddl=kw.get("on_ddl") or "stop",
        target_standbys=bool(kw.get("target_standbys")))
    plan.unprobed = frozenset(u for u in plan.targets if not targets.resolve(u).probed)
    if not plan.sources:
        raise click.UsageError("name the source: --source URL (or --source-shard RANGE=URL)")
    rules = list(kw.get("rules") or ())
    if kw.get("rules_file"):
        rules += load_rules_file(kw["rules_file"])
    specs = parse_rules(rules) if rules else []
    # A pattern matches by name: every table of schema public (or --tables) is checked, and written under
    # the source's names.
    if specs and not any(s.is_pattern for s in specs):
        if plan.kind == "Materialize":  # its tables are the rules' FROM tables (Spark's parser says which)
            from ..rules.compile import from_name
            from ..spark.session import get_spark

            plan.tables = [from_name(get_spark(), s) for s in specs]
        # what is written on the target: each rule's target table
        plan.target_tables = [(schema or "public", name)
                              for schema, name in (split_name(s.target) for s in specs)]
    problems = check(plan)

    def human(_) -> None:
        for p in problems:
            click.echo(p.line())
        bad = len(errors(problems))
        click.echo(f"{bad} problem(s), {len(problems) - bad} warning(s)" if problems else
                   "ok: every database has what the workflow's run needs", err=bool(problems))

    emit({"ok": not errors(problems), "problems": [p.to_json() for p in problems]}, kw["as_json"], human)
    if errors(problems):
        raise SystemExit(1)


def check_group(creates: dict[str, click.Command]) -> click.Group:
    group = click.Group("check", help="Preflight: prove, before `create`, that a workflow's run will have what "
                                      "it needs (the flags are create's).")
    for kind, create in creates.items():
        group.add_command(_from_create(create, kind))
    return group
