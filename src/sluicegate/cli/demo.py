"""`sluicegate demo`: a MoveTables from one throwaway local PostgreSQL to another, under live writes.

Starts a source and a target server, loads the shop data, runs the engine in a background thread while a
writer keeps changing the source, waits for Running, stops the writer, waits until the target has caught
up, proves both sides equal with a vdiff and cleans everything up (unless --keep).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin TimeoutError only from 3.11
from pathlib import Path

import psycopg
from rich.console import Console
from rich.markup import escape

from ..demo import shop
from ..errors import SluicegateError
from ..localpg import LocalPostgres, LocalPostgresError
from ..position import format_lsn, parse_lsn
from ..postgres.connect import connect, first_line, redact
from ..spark.runner import SparkRunner
from ..spark.session import start_in_background
from ..vdiff.executor import DriverVDiffs, execute_or_wait, request
from ..workflow import state as st
from ..workflow.heartbeat import Heartbeat
from ..workflow.status import workflow_status
from .output import print_status
from .progress import ProgressView, read_streams

WORKFLOW = "demo"
DATABASE = "shop"
STEP = "[bold cyan]▸[/] "


class DemoError(SluicegateError):
    """The demo could not finish; the message says where it stopped."""


def run_demo(rows: int = 200_000, keep: bool = False, workdir: str | None = None,
             console: Console | None = None) -> int:
    """0 when the target ends up equal to the source, 1 otherwise; errors raise DemoError."""
    # soft_wrap: long lines (paths, PIDs) stay whole when the output is piped into a file or a test
    if console is None:
        console = Console(highlight=False, soft_wrap=True)
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console.width = 140  # rich's 80 would cut the comparison's md5s in logs and pipes
    if workdir:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    # A fresh directory per run, also under --workdir: a second run never finds an old workflow.
    root = Path(tempfile.mkdtemp(prefix="sluicegate-demo-", dir=workdir))
    demo = _Demo(console, root, rows)
    outcome = "interrupted"  # KeyboardInterrupt and the like: clean up, but no diagnostics
    try:
        equal = demo.run()
        outcome = "done"
        return 0 if equal else 1
    except LocalPostgresError as exc:
        outcome = "failed"
        raise DemoError(f"local PostgreSQL: {str(exc).splitlines()[0]}") from None
    except Exception:
        outcome = "failed"
        raise
    finally:
        demo.cleanup(keep=keep, outcome=outcome)


class _EngineThread(threading.Thread):
    def __init__(self, engine):
        super().__init__(name="sluicegate-demo-engine", daemon=True)
        self.engine = engine
        self.result: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.engine.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the demo's main thread
            self.error = exc


class _Demo:
    def __init__(self, console: Console, root: Path, rows: int):
        self.console, self.root, self.rows = console, root, rows
        self.source: LocalPostgres | None = None
        self.target: LocalPostgres | None = None
        self.pids: dict[str, int] = {}
        self.writer: shop.LiveWriter | None = None
        self.spark = None
        self.spark_future: Future | None = None
        self.runner = None
        self.stop = threading.Event()
        self.engine: _EngineThread | None = None
        self.heartbeat = None
        self.view = None
        self.created = False
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        self.console.print(STEP + text)

    @property
    def source_url(self) -> str:
        return self.source.url(DATABASE)

    @property
    def target_url(self) -> str:
        return self.target.url(DATABASE)

    # -- the story ------------------------------------------------------------------------------------
    def run(self) -> bool:
        self.source = self._start_server("source")
        self.target = self._start_server("target")
        self._pgpass()
        self._start_spark()
        self._load()
        self._create_workflow()
        self._start_engine()
        running_after = self._wait_running()
        self.say(f"workflow {WORKFLOW} is [bold]Running[/] after {running_after:.1f}s: all tables copied, "
                 f"replicating live changes")
        self._show_lag()
        self._stop_writer_and_catch_up()
        equal = self._vdiff()
        print_status(self.console, self._status())
        return equal

    def _start_server(self, side: str) -> LocalPostgres:
        server = LocalPostgres(self.root / side)
        # Assigned before start: cleanup stops whatever got started, even if start itself fails late.
        setattr(self, side, server)
        self.say(f"starting {side} PostgreSQL on {server.host}:{server.port}")
        server.init().start()
        server.create_database(DATABASE)
        self.pids[side] = server.pid
        version = server.psql("SHOW server_version").split()[0]
        self.say(f"{side} PostgreSQL {version} up: pid {server.pid}, port {server.port}, "
                 f"data {server.datadir}")
        return server

    def _pgpass(self) -> None:
        """Sluicegate stores no passwords: libpq finds the servers' in a pgpass file, as a user's would. Set
        before Spark starts, so that its workers inherit it."""
        path = self.root / "pgpass"
        path.write_text(self.source.pgpass_line() + self.target.pgpass_line())
        path.chmod(0o600)
        os.environ["PGPASSFILE"] = str(path)

    def _start_spark(self) -> None:
        """Spark's JVM takes seconds to start: let it start while the data loads."""
        self.say("starting Spark in the background (local, on 127.0.0.1)")
        # A MoveTables without rules: Python tasks only, no rows through the JVM, no Spark SQL.
        self.spark_future = start_in_background(light_jvm=True)

    def _load(self) -> None:
        t0 = time.monotonic()
        self.say(f"creating the shop schema on the source and loading {self.rows:,} rows")
        with psycopg.connect(self.source_url) as conn:
            shop.create_schema(conn)
            counts = shop.load(conn, rows=self.rows)
        listed = ", ".join(f"{t} {n:,}" for t, n in counts.items())
        self.say(f"loaded {sum(counts.values()):,} rows in {time.monotonic() - t0:.1f}s ({listed})")

    def _create_workflow(self) -> None:
        from ..workflow.create import create_movetables

        # Small cycles so the copy takes several snapshots, each followed by catchup and fast-forward.
        cycle = max(2_000, min(50_000, self.rows // 4))
        options = {"cycle_rows": cycle, "chunk_rows": max(1_000, cycle // 2)}
        tables = create_movetables(WORKFLOW, self.source_url, self.target_url, None, [], options)
        self.created = True
        self.say(f"created MoveTables workflow {WORKFLOW}: {len(tables)} tables, copy cycles of "
                 f"{options['cycle_rows']:,} rows in Spark tasks of {options['chunk_rows']:,}")

    def _start_engine(self) -> None:
        from ..workflow.engine import Engine

        self.writer = shop.LiveWriter(self.source_url)
        self.writer.start()
        self.say("live writer started on the source: new orders and customers, updates, deletes")
        try:
            self.spark_future.exception(timeout=300)  # waits; a failed start is the runner's to word
        except FutureTimeout:
            raise DemoError("Spark did not start within 300s: check that `java -version` works and "
                            "that the machine is not overloaded") from None
        self.runner = SparkRunner(self.spark_future)
        try:
            self.spark = self.runner.sc
        except SluicegateError as exc:
            raise DemoError(str(exc)) from None
        self.say(f"Spark {self.spark.version} ready (master {self.spark.master}, "
                 f"started in {self.spark_future.started_in:.1f}s)")

        self.heartbeat = Heartbeat([self.target_url], WORKFLOW).start()
        engine = Engine(self.target_url, WORKFLOW, self.runner, stop=self.stop, vdiffs=DriverVDiffs)
        self.engine = _EngineThread(engine)
        self.engine.start()
        self.say(f"engine running workflow {WORKFLOW} in the background: copying while the writer writes")

    def _status(self) -> dict:
        with connect(self.target_url, role="target", connect_timeout=5) as conn:
            return workflow_status(st.load_workflow(conn, WORKFLOW))

    def _check_engine(self) -> None:
        """Fail fast when the engine thread ended or the stream went to Error."""
        if self.engine.is_alive():
            return
        if self.engine.error is not None:
            exc = self.engine.error
            msg = str(exc) if isinstance(exc, SluicegateError) else first_line(exc)
            raise DemoError(f"the engine of workflow {WORKFLOW} failed: {msg}")
        message = self._status()["message"]
        raise DemoError(f"the engine of workflow {WORKFLOW} ended in {self.engine.result}"
                        + (f": {message}" if message else ""))

    def _poll(self, done: Callable[[], bool], timeout: float, what: str,
              every: Callable[[], None] | None = None) -> float:
        """Poll `done` until true; seconds it took. `every` runs every 2 s (status lines)."""
        t0 = time.monotonic()
        last_report = t0
        while True:
            self._check_engine()
            if done():
                return time.monotonic() - t0
            now = time.monotonic()
            if now - t0 > timeout:
                status = self._status()
                raise DemoError(f"workflow {WORKFLOW} did not {what} within {timeout:.0f}s (it is "
                                f"{status['state']}{': ' + status['message'] if status['message'] else ''}); "
                                f"run with -v to see what the engine does")
            if every and now - last_report >= 2.0:
                every()
                last_report = now
            time.sleep(0.2)

    def _wait_running(self) -> float:
        last_line = [""]

        def running() -> bool:
            status = self._status()
            if status["state"] == st.ERROR:
                raise DemoError(f"workflow {WORKFLOW} is in Error: {status['message']}")
            return status["state"] == st.RUNNING

        def report() -> None:
            status = self._status()
            # with what the engine's copy cycle has moved so far (workflow/live.py), not only copy_state's
            tables = read_streams(self.target_url, WORKFLOW)[0]["tables"]
            parts = [f"{t['table'].removeprefix('public.')} {t['rows_copied']:,}/{t['rows_total']:,}"
                     + (" ✓" if t["state"] == "Copied" else "") for t in tables]
            line = f"  {status['state']}: " + " · ".join(parts)
            if status["message"]:
                line += f"  ({status['message']})"
            if line != last_line[0]:
                self.console.print(line, markup=False)  # engine messages may hold [brackets]
                last_line[0] = line

        if self.console.is_terminal:
            self.view = ProgressView(self.target_url, WORKFLOW, self.console)
            self.view.start()
        try:
            # generous: copy speed varies a lot between machines (2-core CI runners)
            took = self._poll(running, 300 + self.rows / 500, "reach Running", every=None if self.view else report)
            if not self.view:
                report()  # the tables as they ended, not as the last report before saw them
            return took
        finally:
            if self.view:
                self.view.stop()
                self.view = None

    def _show_lag(self) -> None:
        for _ in range(3):
            self.engine.join(1.5)  # writes keep flowing meanwhile; returns early if the engine dies
            self._check_engine()
            lag = self._status()["streams"][0]["lag_seconds"]
            self.say(f"replicating: lag {'-' if lag is None else f'{lag:.2f}s'}, "
                     f"writer at {self.writer.transactions:,} transactions")

    def _stop_writer_and_catch_up(self) -> None:
        self.writer.stop()
        self.writer.join(30)
        if self.writer.is_alive():
            raise DemoError("the demo's live writer did not stop within 30s")
        if self.writer.error is not None:
            raise DemoError(f"the demo's live writer failed: {first_line(self.writer.error)}")
        self.say(f"writer stopped after {self.writer.transactions:,} transactions "
                 f"({self.writer.ops:,} row changes, {self.writer.rollbacks:,} rolled back)")
        with connect(self.source_url, role="source") as conn:
            flushed = parse_lsn(conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])

        def caught_up() -> bool:
            with connect(self.target_url, role="target", connect_timeout=5) as conn:
                row = conn.execute("SELECT position::text FROM sluicegate.streams WHERE workflow = %s",
                                   (WORKFLOW,)).fetchone()
            return row is not None and row[0] is not None and parse_lsn(row[0]) >= flushed

        took = self._poll(caught_up, 120, f"catch up to source position {format_lsn(flushed)}")
        self.say(f"caught up to the source's position {format_lsn(flushed)} in {took:.1f}s")

    def _vdiff(self) -> bool:
        """`sluicegate vdiff`: the running driver compares both sides at one consistent point."""
        from ..vdiff import report

        self.say("vdiff: source and target compared at one consistent point, key range by key range on Spark")
        started = time.monotonic()
        vdiff_id = request(self.target_url, WORKFLOW, None, {}, resume=False)
        execute_or_wait(self.target_url, WORKFLOW, vdiff_id, lambda: self.runner, stop=self.stop)
        with connect(self.target_url, role="target") as conn:
            result = report.build(conn, vdiff_id)
        report.render(self.console, result, verdict=False)
        rows = sum(t["rows_compared"] for t in result["tables"].values())
        if result["equal"]:
            self.say(f"[green]source and target are equal[/]: {len(result['tables'])} tables, {rows:,} rows "
                     f"compared in {time.monotonic() - started:.1f}s")
        else:
            self.say(f"[bold red]source and target differ[/]: {result['differences']:,} rows")
        return result["equal"]

    # -- cleanup --------------------------------------------------------------------------------------
    def cleanup(self, *, keep: bool, outcome: str) -> None:
        """Stop everything we started, each step on its own: one failure must not leave servers behind."""
        if outcome != "done":
            self.say(f"[yellow]{outcome}[/]: stopping what the demo started")
        if self.view:
            self.view.stop()
        if self.writer is not None:
            self.writer.stop()
            self.writer.join(30)
        if self.engine is not None:
            self.stop.set()
            if outcome != "done" and self.runner is not None:
                self._quietly(self.runner.cancel)  # a copy job can take long; interrupted cycles are redone
            self.engine.join(60)
            self.engine.engine.close()
            if self.heartbeat is not None:
                self._quietly(self.heartbeat.stop)
            if self.engine.is_alive():
                self.say("[yellow]the engine did not stop within 60s; exiting anyway")
            else:
                self.say("engine stopped")
        if self.spark is None and self.spark_future is not None:
            # On an interrupt, do not wait for a slow JVM start: Spark's gateway JVM exits with us anyway
            # (it ends when its stdin, our pipe, closes).
            with contextlib.suppress(Exception):  # reported already, or nothing to stop
                self.spark = self.spark_future.result(timeout=120 if outcome != "interrupted" else 5)
        if self.spark is not None:
            self._quietly(self.spark.stop)
            self.say("Spark stopped")
        if keep and self._servers_up():
            self._print_keep()
            return
        if outcome == "failed":
            self._print_log_tails()
        if self.created and not keep and self._servers_up():
            from ..workflow.create import delete_workflow

            try:
                dropped = delete_workflow(WORKFLOW, self.target_url)
                self.say(f"deleted workflow {WORKFLOW}" + (f" ({', '.join(dropped)})" if dropped else ""))
            except Exception as exc:  # noqa: BLE001 - the servers go away next anyway
                self.say(f"[yellow]could not delete workflow {WORKFLOW}: {escape(first_line(exc))}")
        for side in ("source", "target"):
            server = getattr(self, side)
            if server is not None:
                try:
                    server.stop()
                    if side in self.pids:
                        self.say(f"stopped {side} PostgreSQL (pid {self.pids[side]})")
                except Exception as exc:  # noqa: BLE001 - try the other one; kill as a last resort
                    self.say(f"[yellow]stopping {side} PostgreSQL failed ({escape(first_line(exc))}); "
                             f"killing it")
                    self._quietly(server.kill)
        shutil.rmtree(self.root, ignore_errors=True)
        self.say(f"removed {self.root} ({time.monotonic() - self.started:.0f}s in all)")

    def _servers_up(self) -> bool:
        return all(s is not None and s.running for s in (self.source, self.target))

    def _print_keep(self) -> None:
        self.say("kept both servers running (the engine is stopped); password: sluicegate "
                 "(throwaway demo servers only)")
        account = self.source.account.pw_name if self.source.account else None
        for side in ("source", "target"):
            server = getattr(self, side)
            url = server.url(DATABASE)
            self.console.print(f"  {side}: {redact(url)}  (pid {server.pid}, data {server.datadir})")
            self.console.print(f"    connect: psql -h {server.host} -p {server.port} -U {server.user} "
                               f"{DATABASE}")
            stop = shlex.join([str(server.bindir / "pg_ctl"), "-D", str(server.datadir), "stop"])
            if account:
                stop = shlex.join(["su", "-s", "/bin/sh", account, "-c", stop])
            self.console.print(f"    stop:    {stop}   (or: kill {server.pid})")
        target_no_pw = f"postgresql://{self.target.user}@{self.target.host}:{self.target.port}/{DATABASE}"
        self.console.print(f"  workflow: PGPASSFILE={self.root / 'pgpass'} sluicegate workflow status {WORKFLOW} "
                           f"--target {target_no_pw}   (also: workflow run, workflow delete)")
        self.console.print(f"  afterwards: rm -rf {self.root}")

    def _print_log_tails(self) -> None:
        for side in ("source", "target"):
            server = getattr(self, side)
            if server is not None and server.logfile.exists() and server.logfile.stat().st_size:
                self.console.print(f"{side} PostgreSQL {server.log_tail(10)}", markup=False, style="dim")

    def _quietly(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - cleanup goes on
            self.say(f"[yellow]{getattr(fn, '__qualname__', fn)} failed: {escape(first_line(exc))}")
