"""`sluicegate vstream …`: serve a source's changes as Transaction messages over gRPC, and read them."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

import click

from ..errors import UsageError
from ..position import format_lsn, parse_lsn
from ..postgres.connect import connect, describe
from .log import statement_summary
from .output import friendly, line

if TYPE_CHECKING:  # the messages' module (protobuf: slow to import) loads where a command uses it
    from ..changes import model as m

log = logging.getLogger(__name__)


def _threshold(text: str | None) -> int:
    """'65536', '64KiB', '1MiB' -> bytes (0: not given); at least the Segmenter's minimum."""
    if text is None:
        return 0
    from ..changes.segmenter import MIN_THRESHOLD
    from ..changes.translog import parse_size

    size = parse_size(text)
    if size < MIN_THRESHOLD:
        raise UsageError(f"--threshold {text} is below the minimum of {MIN_THRESHOLD} bytes")
    return size


def _tables(text: str | None) -> list[str]:
    if text is None:
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:  # an empty $TABLES must not silently mean "every table"
        raise UsageError("--tables names no table: list them (--tables a,b), or leave --tables out for all")
    return names


def _position(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return parse_lsn(text)
    except ValueError as exc:
        raise UsageError(f"--position: {exc}") from None


def _on_stop_signals(action) -> None:
    """SIGTERM and Ctrl-C run `action` on a helper thread (the main thread may be inside gRPC or psycopg)."""

    def handler(signum, frame):
        threading.Thread(target=action, daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@click.group("vstream", invoke_without_command=True)
@click.option("--server", metavar="HOST:PORT",
              help="A VStream server (`sluicegate vstream serve`) to read from.")
@click.option("--source", metavar="URL",
              help="Or read the source database directly (libpq URL), without a server.")
@click.option("--client-id", default="default", show_default=True,
              help="Names this client's replication slot and publication on the source (sg_vstream_<id>).")
@click.option("--position", default=None, metavar="LSN",
              help="Resume after this position: the last `position` seen with end_segment, or a heartbeat's. "
                   "Default: where the appliers say they stand (postgres, translog), else after what this "
                   "client id last acknowledged (0: its slot, which keeps it).")
@click.option("--tables", default=None, metavar="A,B",
              help="Only these tables (the client's publication is made for them on its first request).")
@click.option("--json", "as_json", is_flag=True,
              help="One Transaction per line (the json applier), and heartbeats as {\"heartbeat\": …} lines.")
@click.option("--threshold", default=None, metavar="BYTES",
              help="transaction_message_threshold: bytes per message before a transaction is segmented "
                   "(64KiB style too; default: the server's, 1MiB).")
@click.option("--applier", "appliers", multiple=True, metavar="SPEC",
              help="Where messages go, e.g. translog:dir=D (repeatable; see plugins).")
@click.option("--replicator", "replicators", multiple=True, metavar="SPEC",
              help="Transform or filter messages first, e.g. filter:tables=public.a;public.b "
                   "(repeatable, in order).")
@click.option("--no-heartbeats", is_flag=True, help="Do not print heartbeats.")
@click.option("--no-streaming", is_flag=True, help="Receive a transaction only once it committed.")
@click.option("--max-messages", type=click.IntRange(1), default=None, metavar="N",
              help="Stop after N Transaction messages.")
@click.option("--decoding-work-mem", default=None, metavar="SIZE",
              help="With --source: logical_decoding_work_mem, past which a transaction streams before "
                   "its commit.")
@click.option("--ca-file", default=None, metavar="PATH",
              help="With --server: connect over TLS, verifying the server's certificate against this CA.")
@click.option("--cert-file", default=None, metavar="PATH",
              help="With --server: this client's certificate, for a server that wants mutual TLS (with "
                   "--key-file).")
@click.option("--key-file", default=None, metavar="PATH", help="The key of --cert-file.")
@click.option("--token-file", default=None, metavar="PATH",
              help="With --server: a file holding the server's token (else SLUICEGATE_VSTREAM_TOKEN; never on "
                   "the command line).")
@click.pass_context
@friendly
def vstream_group(ctx, server, source, client_id, position, tables, as_json, threshold, appliers, replicators,
                  no_heartbeats, no_streaming, max_messages, decoding_work_mem, ca_file, cert_file, key_file,
                  token_file):
    """Read a source's changes as Transaction messages (Drizzle's change model), from a VStream server or
    straight from the source; or `serve` them over gRPC.

    Without --json or --applier, prints one summary line per message. Reconnects after a lost connection
    from the last complete position (a transaction it cut comes again whole, after a ROLLBACK line for it).
    Acknowledges each transaction (and heartbeat) once written and flushed: started again with the same
    --client-id, it resumes right after (after SIGTERM or Ctrl-C nothing comes again; after a kill -9, the
    last second's transactions or so may, each whole). With appliers that keep their own position
    (postgres, translog) it resumes where they stand and acknowledges only what they applied.
    """
    if ctx.invoked_subcommand:
        return
    if bool(server) == bool(source):
        raise UsageError("give one of --server HOST:PORT (a VStream server) or --source URL (read the source "
                         "directly)")
    from ..changes import model as m
    from ..changes.plugins import load_applier, load_replicator
    from ..vstream.client import stream
    from ..vstream.security import ClientSecurity, load_token

    chain = [load_replicator(spec) for spec in replicators]
    sinks = [load_applier(spec) for spec in (("json",) if as_json else ()) + tuple(appliers)]
    summary = not sinks
    # Appliers that keep their own position (postgres, translog) are where a restart resumes: the slot is then
    # acknowledged only up to what they applied, never past it (heartbeats and dropped transactions would
    # put it ahead of them, and a resume from their position would be refused as gone).
    keeping = any(callable(getattr(sink, "position", None)) for sink in sinks)
    start = _position(position) if position is not None else _resume_point(sinks)
    events = stream(server or source, client_id, start, _tables(tables), _threshold(threshold),
                    streaming=not no_streaming, decoding_work_mem=decoding_work_mem,
                    security=ClientSecurity(ca_file, cert_file, key_file, load_token(token_file)))
    _on_stop_signals(events.cancel)
    out = sys.stdout
    count = 0
    try:
        for ev in events:
            if not isinstance(ev, m.Transaction):
                if not no_heartbeats and (as_json or summary):
                    out.write(_heartbeat_line(ev, as_json) + "\n")
                    out.flush()
                if not keeping:
                    events.ack()
                continue
            count += 1
            txn = ev
            for replicator in chain:
                txn = replicator.replicate(txn)
                if txn is None:
                    break
            if txn is not None:
                for sink in sinks:
                    sink.apply(txn)
                if summary:
                    out.write(summary_line(txn) + "\n")
                    out.flush()
            # Written and flushed (the appliers flush at a transaction's end): acknowledged. A message that is
            # not a transaction's last does not move the position: its transaction is acknowledged whole.
            if not keeping:
                events.ack()
            elif txn is not None and ev.end_segment:
                events.ack(ev.context.position)
            if max_messages and count >= max_messages:
                break
    except BrokenPipeError:  # `sluicegate vstream … | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        for sink in sinks:
            sink.close()
        events.close()  # after the appliers finished writing: its last acknowledgement goes out
    if keeping:
        click.echo(f"vstream: stopped after {count} messages; client {client_id} resumes where its appliers "
                   f"stand when started again (--position overrides)", err=True)
    elif events.position <= events.acked:  # everything handed out is acknowledged
        at = f" at position {format_lsn(events.position)}" if events.position else ""
        click.echo(f"vstream: stopped after {count} messages{at}; client {client_id} resumes there when "
                   f"started again (--position overrides)", err=True)
    else:
        why = f" ({events.ack_error})" if events.ack_error else ""
        click.echo(f"vstream: stopped after {count} messages; position {format_lsn(events.position)} was not "
                   f"acknowledged{why}: resume with --position {format_lsn(events.position)}", err=True)


def _resume_point(sinks) -> int:
    """The lowest position the appliers have durably written (0, the slot's own, if one has none)."""
    known = [sink.position() for sink in sinks if callable(getattr(sink, "position", None))]
    if not known or not all(known):
        return 0
    start = min(known)
    log.info("resuming from %s, where the appliers stand", format_lsn(start))
    return start


def _heartbeat_line(hb, as_json: bool) -> str:
    if as_json:
        return line({"heartbeat": {"position": format_lsn(hb.position), "time_us": hb.time_us}})
    return f"heartbeat position {format_lsn(hb.position)}"


def summary_line(txn: m.Transaction) -> str:
    """'txn 731 segment 2 end position 0/1925430: INSERT public.a (120 rows, part 2)'."""
    ctx = txn.context
    statements = "; ".join(statement_summary(st) for st in txn.statements) or "(no statements)"
    return (f"txn {ctx.transaction_id} segment {txn.segment_id}{' end' if txn.end_segment else ''}"
            f"{' streamed' if ctx.streamed else ''} position {format_lsn(ctx.position)}: {statements}")


@vstream_group.command("serve")
@click.option("--source", required=True, metavar="URL", help="libpq URL of the source database.")
@click.option("--port", required=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free one).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--threshold", default=None, metavar="BYTES",
              help="Default transaction_message_threshold (64KiB style too; default 1MiB); a client may "
                   "ask for its own.")
@click.option("--tables", default=None, metavar="A,B",
              help="Tables of a client that names none (default: all of schema public).")
@click.option("--heartbeat-seconds", type=click.FloatRange(0.1), default=1.0, show_default=True,
              help="Send a heartbeat after this long without a message.")
@click.option("--decoding-work-mem", default=None, metavar="SIZE",
              help="logical_decoding_work_mem of the walsenders, past which a transaction streams before its "
                   "commit (e.g. 64kB; default: the source's).")
@click.option("--cert-file", default=None, metavar="PATH",
              help="Serve over TLS with this certificate (PEM; with --key-file).")
@click.option("--key-file", default=None, metavar="PATH", help="The key of --cert-file (PEM).")
@click.option("--client-ca-file", default=None, metavar="PATH",
              help="Mutual TLS: admit only clients with a certificate this CA signed.")
@click.option("--token-file", default=None, metavar="PATH",
              help="Admit only clients that send the token in this file (else SLUICEGATE_VSTREAM_TOKEN, if set; "
                   "never on the command line).")
@click.option("--insecure", is_flag=True,
              help="Serve an address other than loopback without TLS and client authentication anyway.")
@friendly
def serve(source, port, host, threshold, tables, heartbeat_seconds, decoding_work_mem, cert_file, key_file,
          client_ca_file, token_file, insecure):
    """Serve the source's changes over gRPC (VStream.Stream) until SIGTERM or Ctrl-C.

    Off loopback (e.g. --host 0.0.0.0) it needs TLS (--cert-file, --key-file) and client authentication
    (--client-ca-file and/or a token), or --insecure."""
    from ..changes.segmenter import DEFAULT_THRESHOLD
    from ..postgres.capture import check_source
    from ..vstream.security import ServerSecurity, load_token
    from ..vstream.server import VStreamServer

    security = ServerSecurity(cert_file, key_file, client_ca_file, load_token(token_file), insecure)
    security.check(host)  # before anything else: a refusal costs nothing
    with connect(source, role="source") as conn:  # fail fast, with the way out, before listening
        check_source(conn)
    server = VStreamServer(source, port, host, security, threshold=_threshold(threshold) or DEFAULT_THRESHOLD,
                           tables=_tables(tables), heartbeat_seconds=heartbeat_seconds,
                           decoding_work_mem=decoding_work_mem)
    stop = threading.Event()
    _on_stop_signals(stop.set)
    server.start()
    click.echo(f"vstream: serving {describe(source)} on {server.address}", err=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    click.echo("vstream: stopped", err=True)
