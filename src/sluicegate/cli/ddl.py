"""`sluicegate ddl install|remove --source URL`: the source's DDL capture (ddl/capture.py)."""

from __future__ import annotations

import click

from ..postgres.connect import connect
from .output import friendly

SOURCE = click.option("--source", required=True, metavar="URL",
                      help="libpq URL of the source database, as a superuser (event triggers need one).")
PRINT = click.option("--print", "print_only", is_flag=True,
                     help="Print the SQL instead of running it (for a superuser to run).")
# A create's DDL mode (ddl/modes.py); `workflow set --on-ddl` changes it later.
ON_DDL = click.option(
    "--on-ddl", type=click.Choice(("stop", "ignore", "exec", "exec-ignore")), default=None,
    help="What the stream does with a DDL statement captured on the source (`sluicegate ddl install`) on a moved "
         "table: stop (default: Error naming it; an added column follows), ignore, exec (apply it on the target "
         "in place), exec-ignore (apply; pass it over if it fails).")


@click.group("ddl")
def ddl_group() -> None:
    """Capture schema changes on a source, so workflows replay them as their --on-ddl says."""


def _do(source: str, which: str, print_only: bool) -> None:
    from ..ddl import capture

    statements = capture.install_statements() if which == "install" else capture.remove_statements()
    if print_only:
        with connect(source, role="source") as conn:
            click.echo(capture.script(statements, conn), nl=False)
        return
    capture.run(source, statements, which.capitalize())
    click.echo("DDL capture installed: event triggers " + ", ".join(capture.TRIGGERS) if which == "install"
               else "DDL capture removed")


@ddl_group.command("install")
@SOURCE
@PRINT
def ddl_install(source, print_only):
    """Install the event triggers that put each DDL statement into the WAL, in its transaction."""
    friendly(_do)(source, "install", print_only)


@ddl_group.command("remove")
@SOURCE
@PRINT
def ddl_remove(source, print_only):
    """Remove them: schema changes then meet the stream as Relation messages only."""
    friendly(_do)(source, "remove", print_only)
