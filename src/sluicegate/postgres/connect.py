"""Connections to source and target: one session setup, one way to report connection failures.

Every Sluicegate session uses the same output settings, so the text form of a value read on one side
(COPY text, pgoutput text) is parsed identically on the other (UTC times, ISO dates, exact floats).
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..errors import ConnectError, SluicegateError, UsageError
from ..redact import first_line, redact  # (re-exported: callers read them here)

if TYPE_CHECKING:
    import psycopg

SESSION_OPTIONS = (
    "-c TimeZone=UTC -c DateStyle=ISO,YMD -c IntervalStyle=postgres "
    "-c extra_float_digits=3 -c bytea_output=hex -c client_encoding=UTF8 -c lc_monetary=C "
    # Like pg_dump: a snapshot holder sits idle in its transaction while Spark tasks read, and a copy's COPY
    # runs as long as the table is big; a server default meant for applications must not cut them off.
    "-c statement_timeout=0 -c idle_in_transaction_session_timeout=0"
)

# A peer behind a cut network sends no FIN and no RST: without these a session waits on it for the kernel's
# two hours. libpq's keepalives and TCP_USER_TIMEOUT end a client session ~30 s after the peer last answered
# (then the step is retried with backoff); the same values set on the server's side of the session
# (tcp_keepalives_*, tcp_user_timeout) end the backend too, so its locks (the run lock) and the slot's
# walsender are freed rather than held by a session nobody will read. A URL's own values win.
LIVENESS = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "4",
            "tcp_user_timeout": "30000"}
_SERVER_LIVENESS = {"keepalives_idle": "tcp_keepalives_idle", "keepalives_interval": "tcp_keepalives_interval",
                    "keepalives_count": "tcp_keepalives_count", "tcp_user_timeout": "tcp_user_timeout"}


def liveness(url: str) -> tuple[dict, str]:
    """(libpq parameters, server `-c` options) that end a session whose peer stopped answering: LIVENESS,
    less what the URL sets itself, and the server's side of the same values."""
    try:
        given = _parse(url)
    except ValueError:
        given = {}  # connecting says what is wrong with it
    if str(given.get("keepalives", "1")) == "0":  # turned off in the URL: only what the URL itself says
        return {}, ""
    client = {k: v for k, v in LIVENESS.items() if k not in given}
    effective = {**LIVENESS, **{k: str(v) for k, v in given.items() if k in LIVENESS}}
    server = " ".join(f"-c {guc}={int(effective[k])}" for k, guc in _SERVER_LIVENESS.items()
                      if str(effective[k]).isdigit())
    return client, server


def session_options(url: str, extra: str = "") -> dict:
    """Keyword arguments for psycopg/psycopg2 connect: Sluicegate's session options and liveness."""
    client, server = liveness(url)
    return {**client, "options": " ".join(o for o in (SESSION_OPTIONS, server, extra) if o)}


@contextmanager
def usage_errors(where: str):
    """A database error met inside is the user's to mend (a right, an object, a setting): one UsageError line
    that says on which side, `where`."""
    import psycopg

    try:
        yield
    except psycopg.Error as exc:
        raise UsageError(f"{where}: {first_line(exc)}") from None


def describe(url: str) -> str:
    """'host:port/dbname' for messages; a URL that lists several hosts: 'h1:p1,h2:p2/dbname' (`describe_conn`
    names the one a session reached)."""
    try:
        info = _parse(url)
    except ValueError:
        return redact(url)
    hosts = (info.get("host") or "localhost").split(",")
    ports = (info.get("port") or "5432").split(",")
    if len(ports) == 1:  # libpq: one port for every host
        ports = ports * len(hosts)
    where = ",".join(f"{h or 'localhost'}:{p or '5432'}" for h, p in zip(hosts, ports, strict=False))
    return f"{where}/{info.get('dbname') or info.get('user') or ''}"


def describe_conn(conn) -> str:
    """'host:port/dbname' of the server a session (psycopg 3 or psycopg2) is connected to: of a URL that lists
    several hosts, the one libpq chose."""
    info = conn.info
    return f"{info.host}:{info.port}/{info.dbname}"


def _parse(url: str) -> dict:
    """The conninfo's keywords (URL or key=value), parsed by libpq through psycopg2 where it is loaded already
    (a Spark copy task's worker, which never needs psycopg 3), else psycopg 3; ValueError if it is not one."""
    if "psycopg2.extensions" in sys.modules:
        import psycopg2
        import psycopg2.extensions

        try:
            return psycopg2.extensions.parse_dsn(url)
        except psycopg2.ProgrammingError as exc:
            raise ValueError(str(exc)) from None
    import psycopg  # here, not at the top: see above

    try:
        return psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ValueError(str(exc)) from None


def primary_only(url: str) -> dict:
    """Connection keywords to add to `url`: target_session_attrs=read-write when it lists several hosts and
    says nothing of which to take (nor does PGTARGETSESSIONATTRS).

    A PostgreSQL user lists a primary and its standby (libpq multi-host) so that libpq finds whichever is the
    primary now, after a failover too. Without target_session_attrs libpq takes the first host that answers,
    and a standby answers: there a slot can be neither created nor read (a synchronized one is read-only until
    promotion), a snapshot's position is not the primary's, and a target cannot be written. Every Sluicegate
    session needs the primary, so it asks for one, as the user meant, rather than refusing the URL. A
    target_session_attrs the URL gives is the user's and is kept."""
    try:
        info = _parse(url)
    except ValueError:
        return {}  # connecting says what is wrong with it
    if info.get("target_session_attrs") or os.environ.get("PGTARGETSESSIONATTRS"):
        return {}
    hosts = info.get("host") or info.get("hostaddr") or os.environ.get("PGHOST") or os.environ.get("PGHOSTADDR")
    return {"target_session_attrs": "read-write"} if hosts and "," in hosts else {}


_URI = re.compile(r"^(postgres(?:ql)?://)([^/?#]*)(.*)$", re.IGNORECASE | re.DOTALL)
_SECRETS = ("password", "sslpassword")  # sslpassword decrypts a client key: a secret as much as the password


def strip_password(url: str) -> str:
    """The conninfo (URL or key=value) without its password, everything else kept: what Sluicegate stores and
    hands to Spark tasks. libpq then finds the password itself: PGPASSWORD, the pgpass file (PGPASSFILE,
    ~/.pgpass) or the service file. TLS file parameters (sslrootcert, sslcert, sslkey) stay: they are paths,
    and the files' content is never read here. A client key's sslpassword goes too (use a key without one)."""
    m = _URI.match(url)
    if m:
        scheme, netloc, rest = m.groups()
        if "@" in netloc:
            userinfo, _, hosts = netloc.rpartition("@")
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}@{hosts}" if user else hosts
        path, q, query = rest.partition("?")
        if q:
            params = [p for p in query.split("&") if p and p.split("=", 1)[0].lower() not in _SECRETS]
            rest = path + ("?" + "&".join(params) if params else "")
        return scheme + netloc + rest
    import psycopg

    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return url  # not a conninfo: connecting says so (and redact() keeps it out of the message)
    if not any(k in info for k in _SECRETS):
        return url
    for k in _SECRETS:
        info.pop(k, None)
    return psycopg.conninfo.make_conninfo(**info)


def has_password(url: str) -> bool:
    return strip_password(url) != url


class NoPasswordError(UsageError):
    """The server wants a password and libpq found none: Sluicegate stores none, so it comes from libpq."""


PGPASS_HINT = ("add it to a pgpass file (PGPASSFILE, else ~/.pgpass; a line host:port:dbname:user:password, "
               "mode 0600), a service file, or PGPASSWORD: Sluicegate stores no passwords")


def connect_failure(role: str, url: str, message: str) -> SluicegateError:
    """The error for a refused connection (libpq's one-line `message`), with the way out when there is one."""
    where = describe(url)
    lower = message.lower()
    if "no password supplied" in lower:
        return NoPasswordError(f"no password for {role} {where} (user {_user(url)}): {PGPASS_HINT}")
    return ConnectError(f"cannot connect to {role} {where}: {message}{connect_hint(role, message)}")


def connect_hint(role: str, message: str) -> str:
    """': the way out' for libpq's refusal `message`, or ''."""
    lower = message.lower()
    hint = next((h for needle, h in _CONNECT_HINTS if needle in lower), None)
    return f": {hint.format(role=role)}" if hint else ""


def _user(url: str) -> str:
    import getpass

    import psycopg

    try:
        return psycopg.conninfo.conninfo_to_dict(url).get("user") or os.environ.get("PGUSER") or getpass.getuser()
    except (psycopg.ProgrammingError, KeyError, OSError):
        return "?"


# The way out for the usual reasons a connection is refused (matched on libpq's message: a refusal before the
# server has said anything, TLS ones included, comes with no SQLSTATE).
_TLS_FILES = ("sslrootcert must name a CA file that exists on this host (on Spark executors too: the same path on "
              "every host, see the README's TLS section)")
_NO_ENTRY_PLAIN = ("allow this client in the {role} server's pg_hba.conf; if it admits TLS connections only "
                   "(hostssl), add sslmode=verify-full&sslrootcert=CA-FILE to the {role} URL")
_CONNECT_HINTS = (
    ("certificate verify failed", ("the {role} server's certificate is not signed by the CA in sslrootcert "
                                  "(or PGSSLROOTCERT): point it at the CA file that signed that certificate")),
    ("does not match host name", ("connect to the {role} server by a name or address its certificate lists "
                                 "(subject alternative names), or reissue the certificate for this one")),
    ("root certificate file", _TLS_FILES),
    # PostgreSQL 12+ ends every pg_hba refusal of a plain connection with ", no encryption"
    ("no encryption", _NO_ENTRY_PLAIN),
    ("server does not support ssl", "enable TLS on the {role} server (ssl=on), or lower sslmode in the URL"),
    ("certificate file", ("sslcert and sslkey must name the client certificate and its key (mode 0600) on "
                         "this host")),
    ("password authentication failed", "check the {role} user's password (pgpass file, PGPASSWORD or URL)"),
    ("no pg_hba.conf entry", "allow this client in the {role} server's pg_hba.conf"),
    ("connection refused", "is PostgreSQL running and listening on that host and port?"),
    ("timeout expired", "is the host reachable (address, firewall)?"),
    ("could not translate host name", "check the host name in the {role} URL"),
    ("failed to resolve host", "check the host name in the {role} URL"),
)


def connect(url: str, *, role: str, autocommit: bool = False, **kwargs) -> psycopg.Connection:
    """Open a session with Sluicegate's settings. `role` ('source' or 'target') only names the side in errors."""
    import psycopg

    try:
        return psycopg.connect(
            url, autocommit=autocommit, **session_options(url),
            application_name=kwargs.pop("application_name", "sluicegate"),
            connect_timeout=kwargs.pop("connect_timeout", 10), **{**primary_only(url), **kwargs},
        )
    except psycopg.OperationalError as exc:
        raise connect_failure(role, url, first_line(exc)) from None
    except psycopg.ProgrammingError as exc:  # malformed URL
        raise ConnectError(f"bad {role} URL {redact(url)}: {first_line(exc)}") from None
