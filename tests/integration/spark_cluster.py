"""Real Spark clusters for the integration tests, and where a task really ran.

- `StandaloneCluster`: a standalone master and one worker started from the installed PySpark
  (`spark-class …deploy.master.Master` / `…deploy.worker.Worker`), optionally with the worker in a network
  namespace (`NetworkNamespace`, a second host on a /30 link of the test's own).
- `LocalCluster`: `local-cluster[N,cores,mem]`, whose workers live in the driver's JVM but whose executors
  are processes of their own.
- `executor_chain`: the process that holds a PostgreSQL connection (found through its socket) and its
  ancestors, so a test can assert that a task ran in an executor JVM's Python worker, not in the driver.

Every process started here is stopped by its PID; the namespace and its link go even when a test fails.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psycopg

from sluicegate.procs import pid_alive

from ..conftest import wait_for
from .helpers import stream_row

EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
SUBMIT_CLASS = "org.apache.spark.deploy.SparkSubmit"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


def spark_home() -> Path:
    """The installed PySpark's directory: its bin/spark-class and jars run the cluster's daemons."""
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home())


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --- processes -----------------------------------------------------------------------------------------

def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def ancestry(pid: int) -> list[int]:
    """pid, its parent, and so on up to PID 1."""
    chain = [pid]
    while chain[-1] > 1 and (up := parent(chain[-1])) > 0:
        chain.append(up)
    return chain


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*"):
        children.setdefault(parent(int(stat.name)), []).append(int(stat.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _hex_addr(ip: str, port: int) -> str:
    """An IPv4 endpoint as /proc/net/tcp writes it: the address's bytes in host (little-endian) order."""
    return f"{int.from_bytes(ipaddress.IPv4Address(ip).packed, 'little'):08X}:{port:04X}"


def socket_owners(local_ip: str, local_port: int, remote_port: int) -> list[int]:
    """The processes holding the TCP socket bound to local_ip:local_port that is connected to remote_port,
    in whichever network namespace it is."""
    local = _hex_addr(local_ip, local_port)
    inodes, seen_ns = set(), set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ns = os.readlink(proc / "ns" / "net")
            if ns in seen_ns:
                continue
            seen_ns.add(ns)
            for line in (proc / "net" / "tcp").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[1] == local and fields[2].endswith(f":{remote_port:04X}"):
                    inodes.add(f"socket:[{fields[9]}]")
        except OSError:
            continue
    owners = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                owners.append(int(proc.name))
        except OSError:
            continue
    return owners


def executor_chain(url: str, backend_pid: int) -> list[int]:
    """The process at the client end of a PostgreSQL backend's connection (`url` reaches that server), and
    its ancestors: [task process, …, executor JVM, …]. Fails the test when none holds it."""
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT host(client_addr), client_port, current_setting('port')::int "
                        "FROM pg_stat_activity WHERE pid = %s", (backend_pid,)).fetchone()
    assert row and row[0], f"backend {backend_pid} has no TCP client"
    owners = socket_owners(*row)
    assert len(owners) == 1, f"the client of backend {backend_pid} ({row[0]}:{row[1]}): processes {owners}"
    return ancestry(owners[0])


def describe(chain: list[int]) -> str:
    return "; ".join(f"{p}: {cmdline(p)[:140]}" for p in chain)


def slot_reader(source_url: str, slot: str) -> int:
    """The backend PID of the slot's replication connection (held by its play task while it runs)."""
    with psycopg.connect(source_url, autocommit=True) as c:
        return wait_for(lambda: c.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                          (slot,)).fetchone()[0], what=f"a walsender on slot {slot}")


def walsender(pair, workflow: str) -> int:
    return slot_reader(pair.source, stream_row(pair, workflow)["slot"])


def replication_chain(pair, workflow: str) -> list[int]:
    """executor_chain of the stream's replication connection."""
    return executor_chain(pair.source, walsender(pair, workflow))


def rule_reader_chain(url: str, busy, timeout: float = 120) -> list[int]:
    """executor_chain of a rule player's reader: a batch's peek at the slot, one short connection a batch,
    so caught while a thread keeps writing (`busy()`) and one held session polls for it."""
    import threading

    from sluicegate.workflow.rule_player import READER

    stop = threading.Event()

    def write():
        while not stop.is_set():
            busy()
            stop.wait(0.02)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        with psycopg.connect(url, autocommit=True) as c:
            def find():
                row = c.execute("SELECT host(client_addr), client_port, current_setting('port')::int "
                                "FROM pg_stat_activity WHERE application_name = %s AND client_port > 0",
                                (READER,)).fetchone()
                owners = socket_owners(*row) if row else []
                return ancestry(owners[0]) if len(owners) == 1 else None

            return wait_for(find, timeout=timeout, interval=0.002, what="a rule player's reader on the source")
    finally:
        stop.set()
        writer.join()


def _stop(pid: int, timeout: float = 30) -> None:
    """SIGTERM (a Spark daemon then stops what it started), SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pid_alive(pid):
            return


# --- a network namespace: a second host ----------------------------------------------------------------

class NamespaceUnavailable(RuntimeError):
    pass


class NetworkNamespace:
    """`ip netns add` and a veth pair on a /30 of 10.213.0.0/16 that no interface here uses yet: the host
    side gets the first address, the namespace side the second. The namespace has no other route, so a
    process in it reaches nothing but the host side's address."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.name, self.host_link, self.ns_link = f"sgtest{tag}", f"sgh{tag}", f"sgn{tag}"
        self.network = self.host_ip = self.ns_ip = None
        self._made: list[list[str]] = []  # how to undo what was made, last first

    def _ip(self, *args: str, ns: bool = False) -> None:
        cmd = (["ip", "netns", "exec", self.name] if ns else []) + ["ip", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode:
            raise NamespaceUnavailable(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")

    def _pick_network(self) -> ipaddress.IPv4Network:
        used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                              check=False).stdout
        taken = {ipaddress.ip_interface(line.split()[3]).network for line in used.splitlines()
                 if len(line.split()) > 3}
        nets = list(ipaddress.ip_network("10.213.0.0/16").subnets(new_prefix=30))
        start = os.getpid() % len(nets)
        for net in nets[start:] + nets[:start]:
            if not any(net.overlaps(t) for t in taken):
                return net
        raise NamespaceUnavailable("no free /30 in 10.213.0.0/16")

    def __enter__(self):
        if shutil.which("ip") is None:
            raise NamespaceUnavailable("no `ip` command (iproute2)")
        try:
            self._ip("netns", "add", self.name)
            self._made.append(["netns", "delete", self.name])
            self.network = self._pick_network()
            host, ns = list(self.network.hosts())
            self.host_ip, self.ns_ip = str(host), str(ns)
            self._ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.ns_link)
            self._made.append(["link", "delete", self.host_link])  # its peer goes with it
            self._ip("link", "set", self.ns_link, "netns", self.name)
            self._ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_link)
            self._ip("link", "set", self.host_link, "up")
            self._ip("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_link, ns=True)
            self._ip("link", "set", self.ns_link, "up", ns=True)
            self._ip("link", "set", "lo", "up", ns=True)  # Python workers talk to their executor over it
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        while self._made:
            args = self._made.pop()
            subprocess.run(["ip", *args], capture_output=True, check=False)

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


# --- clusters --------------------------------------------------------------------------------------------

class StandaloneCluster:
    """A standalone master on `host` and one worker (on `host` too, or inside `netns` on its address),
    started with spark-class from the installed PySpark. `spark_args`: what `workflow run`/`vdiff` need."""

    kind = "standalone"

    def __init__(self, workdir: Path, host: str = "127.0.0.1", netns: NetworkNamespace | None = None,
                 cores: int = 2, memory: str = "1g"):
        self.workdir, self.host, self.netns = Path(workdir), host, netns
        self.worker_host = netns.ns_ip if netns else host
        self.cores, self.memory = cores, memory
        self.port, self.ui_port = free_port(host), free_port(host)
        self.url = f"spark://{host}:{self.port}"
        self.spark_args = ["--spark-master", self.url]
        self.master_pid = self.worker_pid = None
        self._logs: dict[str, Path] = {}
        self._procs: dict[int, subprocess.Popen] = {}

    def _spawn(self, role: str, argv: list[str], local_ip: str, prefix: list[str]) -> int:
        env = {**os.environ, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": local_ip,
               "PYSPARK_PYTHON": sys.executable, "SPARK_LOG_DIR": str(self.workdir),
               "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false"}  # no submission server on 6066
        env.pop("SPARK_CONF_DIR", None)
        log = self._logs[role] = self.workdir / f"{role}.log"
        with log.open("ab") as out:
            # spark-class (and `ip netns exec`) exec the JVM: this PID is the daemon's own
            proc = subprocess.Popen([*prefix, str(spark_home() / "bin" / "spark-class"), *argv], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.workdir)
        self._procs[proc.pid] = proc
        return proc.pid

    def state(self) -> dict:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        with opener.open(f"http://{self.host}:{self.ui_port}/json/", timeout=5) as r:
            return json.load(r)

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(f"--- {role} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                         for role, p in self._logs.items() if p.exists())

    def executor_logs(self, chars: int = 3000) -> str:
        logs = sorted((self.workdir / "work").glob("app-*/*/stderr"), key=lambda p: p.stat().st_mtime)
        return "".join(f"--- {p} ---\n{p.read_text(errors='replace')[-chars:]}" for p in logs[-2:])

    def __enter__(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.master_pid = self._spawn("master", [
                "org.apache.spark.deploy.master.Master", "--host", self.host, "--port", str(self.port),
                "--webui-port", str(self.ui_port)], self.host, [])
            wait_for(lambda: self.state()["status"] == "ALIVE", timeout=120, interval=0.2,
                     what="the Spark master up", describe=self.log_tail)
            ui = "0" if self.netns else str(free_port(self.host))
            self.worker_pid = self._spawn("worker", [
                WORKER_CLASS, "--host", self.worker_host, "--cores", str(self.cores), "--memory", self.memory,
                "--webui-port", ui, "--work-dir", str(self.workdir / "work"), self.url],
                self.worker_host, self.netns.exec_prefix() if self.netns else [])
            wait_for(lambda: [w for w in self.state()["workers"]
                              if w["state"] == "ALIVE" and w["host"] == self.worker_host],
                     timeout=120, interval=0.2, what="the Spark worker registered", describe=self.log_tail)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        # The worker kills its executors when it stops; any it left behind are killed by their PIDs.
        executors = [p for p in descendants(self.worker_pid) if EXECUTOR_CLASS in cmdline(p)] \
            if self.worker_pid else []
        for pid in (self.worker_pid, *executors, self.master_pid):
            if pid:
                _stop(pid)
                if pid in self._procs:
                    self._procs.pop(pid).wait(timeout=30)  # reaped: no zombie left behind

    def assert_in_executor(self, chain: list[int], driver_pid: int) -> int:
        """The chain (executor_chain) runs in an executor under this cluster's worker, outside the driver's
        process tree; the executor JVM's PID."""
        executor = next((p for p in chain if EXECUTOR_CLASS in cmdline(p)), None)
        assert executor is not None, f"not in an executor: {describe(chain)}"
        assert self.worker_pid in chain and driver_pid not in chain, describe(chain)
        return executor


class LocalCluster:
    """`local-cluster[workers,cores,memory MB]`: the driver's JVM runs the master and workers, which start
    executors as processes of their own. Those leave their logs in $SPARK_HOME/work: removed at the end
    (the applications that appeared meanwhile)."""

    kind = "local-cluster"

    def __init__(self, workers: int = 2, cores: int = 1, memory_mb: int = 1024):
        self.url = f"local-cluster[{workers},{cores},{memory_mb}]"
        self.spark_args = ["--spark-master", self.url]
        self._work = spark_home() / "work"

    def _apps(self) -> set[Path]:
        return set(self._work.glob("app-*")) if self._work.is_dir() else set()

    def __enter__(self):
        self._before = self._apps()
        self._had_work = self._work.is_dir()
        return self

    def __exit__(self, *exc) -> None:
        for app in self._apps() - self._before:
            shutil.rmtree(app, ignore_errors=True)
        if not self._had_work and self._work.is_dir() and not any(self._work.iterdir()):
            self._work.rmdir()

    def executor_logs(self, chars: int = 3000) -> str:
        apps = sorted(self._apps() - self._before, key=lambda p: p.stat().st_mtime)
        return "".join(f"--- {p} ---\n{p.read_text(errors='replace')[-chars:]}"
                       for app in apps[-1:] for p in app.glob("*/stderr"))

    def assert_in_executor(self, chain: list[int], driver_pid: int) -> int:
        """The chain runs in an executor JVM of its own, started by the driver's JVM (which hosts the
        local cluster's workers): neither the driver's Python nor its JVM runs the task."""
        executor = next((p for p in chain if EXECUTOR_CLASS in cmdline(p)), None)
        assert executor is not None, f"not in an executor: {describe(chain)}"
        driver_jvm = next((p for p in chain if SUBMIT_CLASS in cmdline(p)), None)
        assert driver_jvm is not None and driver_jvm != executor, describe(chain)
        assert chain.index(executor) < chain.index(driver_jvm) < chain.index(driver_pid), describe(chain)
        assert chain[0] not in (driver_pid, driver_jvm), describe(chain)
        return executor


# --- the command line ------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)  # set by an in-process Spark session of this test run
    env.pop("SLUICEGATE_SPARK_MASTER", None)
    return env


def start_driver(workflow: str, target: str, log: Path, spark_args: list[str]) -> subprocess.Popen:
    """`sluicegate workflow run` in a session of its own (its JVM and local executors with it)."""
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "-v", "workflow", "run",
                                 workflow, "--target", target, "--no-progress", *spark_args], env=_env(),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _session_left(sid: int) -> list[int]:
    """Live processes of the session `sid` (a command started with start_new_session: its PID)."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                left.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return left


def _reap_session(proc: subprocess.Popen, grace: float = 30) -> None:
    """After the command exited: its JVM and a local cluster's executors go too (they shut down after it);
    what is still there after `grace` is killed by its session's process group."""
    deadline = time.monotonic() + grace
    while _session_left(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _session_left(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def stop_driver(proc: subprocess.Popen, timeout: float = 90) -> int:
    """SIGTERM (a clean stop), its exit status; the whole session is killed if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        rc = -signal.SIGKILL
    _reap_session(proc)
    return rc


def sluicegate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A command to its end, in a session of its own (a vdiff may start Spark: its processes go with it)."""
    proc = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=_env(),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        _reap_session(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
