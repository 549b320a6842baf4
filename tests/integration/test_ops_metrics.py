"""`workflow run` observed from outside: its Prometheus endpoint, its progress lines in a file and its log
file, while it copies and while it replicates."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import wait_for
from .helpers import reap_group

pytestmark = pytest.mark.spark


def sg(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluicegate.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float | None:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


COPY_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} INFO sluicegate\.progress: "
    r"copy public\.items: ([\d,]+)/300,000 rows \(\d+%\), [\d,]+ rows/s$",
    re.MULTILINE,
)
REPLICATE_LINE = re.compile(
    r"INFO sluicegate\.progress: replicate stream 1: lag [\d.]+s, position [0-9A-F]+/[0-9A-F]+, "
    r"([\d,]+) rows applied since the last line, [\d,]+ rows/s$",
    re.MULTILINE,
)


def test_metrics_progress_lines_and_logs(pair, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 300000) g")
    created = sg(
        "movetables",
        "create",
        "--workflow",
        "m",
        "--source",
        pair.source,
        "--target",
        pair.target,
        "--cycle-rows",
        "20000",
        "--chunk-rows",
        "10000",
    )
    assert created.returncode == 0, created.stderr
    port = free_port()
    out, err, logfile = tmp_path / "stdout", tmp_path / "stderr", tmp_path / "driver.log"
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sluicegate.cli.main",
            "workflow",
            "run",
            "m",
            "--target",
            pair.target,
            "--metrics-port",
            str(port),
            "--progress-interval",
            "1",
            "--log-level",
            "info",
            "--log-file",
            str(logfile),
        ],
        stdout=out.open("wb"),
        stderr=err.open("wb"),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    source = f"127.0.0.1:{pair.source_server.port}/{pair.name}"
    stream = {"workflow": "m", "stream": "1", "source": source}
    table = {**stream, "table": "public.items"}
    try:

        def copying_rows():
            m = scrape(port)
            copied = value(m, "sluicegate_rows_copied_total", **table)
            return (
                m if value(m, "sluicegate_stream_state", **stream, state="Copying") == 1 and copied else None
            )

        log = lambda: err.read_text()[-1000:] + out.read_text()[-1000:]
        first = wait_for(
            copying_rows, timeout=240, interval=0.2, what="rows copied while Copying", describe=log
        )
        assert value(first, "sluicegate_driver_up", workflow="m") == 1
        assert value(first, "sluicegate_target_up", workflow="m") == 1
        assert value(first, "sluicegate_table_copied", **table) == 0
        assert value(first, "sluicegate_table_rows_estimated", **table) >= 250_000
        assert value(first, "sluicegate_retained_wal_bytes", **stream) >= 0
        before = value(first, "sluicegate_rows_copied_total", **table)
        # values move: more rows copied while the copy still runs
        wait_for(
            lambda: (m := copying_rows()) and value(m, "sluicegate_rows_copied_total", **table) > before,
            timeout=120,
            interval=0.2,
            what="rows copied to grow",
            describe=log,
        )
        # `workflow run > file`: a line per interval with the rows copied so far and the rate
        wait_for(
            lambda: any(int(n.replace(",", "")) < 300_000 for n in COPY_LINE.findall(out.read_text())),
            timeout=120,
            what="a progress line during the copy",
            describe=log,
        )

        running = wait_for(
            lambda: (
                (m := scrape(port))
                and value(m, "sluicegate_stream_state", **stream, state="Running") == 1
                and m
            ),
            timeout=240,
            what="Running",
            describe=log,
        )
        assert value(running, "sluicegate_rows_copied_total", **table) == 300_000
        assert value(running, "sluicegate_table_copied", **table) == 1
        applied, position = (
            value(running, n, **stream)
            for n in ("sluicegate_rows_applied_total", "sluicegate_applied_position_bytes")
        )
        batches = value(running, "sluicegate_batches_total", **stream)
        pair.src("UPDATE items SET qty = qty + 1 WHERE id <= 500")
        pair.src("INSERT INTO items SELECT g, 1, 'new' FROM generate_series(300001, 300100) g")

        def replicated():
            m = scrape(port)
            return m if value(m, "sluicegate_rows_applied_total", **stream) >= applied + 600 else None

        after = wait_for(replicated, timeout=120, what="600 rows applied", describe=log)
        assert value(after, "sluicegate_applied_position_bytes", **stream) > position
        assert value(after, "sluicegate_batches_total", **stream) > batches
        assert value(after, "sluicegate_lag_seconds", **stream) is not None
        lines = wait_for(
            lambda: [int(n.replace(",", "")) for n in REPLICATE_LINE.findall(out.read_text())],
            timeout=60,
            what="a replicate progress line",
            describe=log,
        )
        wait_for(
            lambda: sum(int(n.replace(",", "")) for n in REPLICATE_LINE.findall(out.read_text())) >= 600,
            timeout=60,
            what="the applied rows in the progress lines",
            describe=log,
        )
        assert lines
        assert value(after, "sluicegate_retries_total", **stream) == 0
        assert value(after, "sluicegate_errors_total", **stream) == 0
        wal = value(after, "sluicegate_retained_wal_bytes", **stream)
        assert wal is not None and wal >= 0
        assert pair.dst("SELECT count(*) FROM items") == [(300_100,)]
        # no password in what is served
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert ":sluicegate@" not in r.read().decode()

        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log()
        # levelled lines with the logger's name, in the log file (the progress lines too), no library noise
        logged = logfile.read_text()
        assert re.search(
            r"^\S+ \S+ INFO sluicegate: copying public\.items in \d+ tasks$", logged, re.MULTILINE
        ), logged
        assert COPY_LINE.search(logged)
        assert "py4j" not in logged and " DEBUG " not in logged
        assert "INFO" not in err.read_text()
    finally:
        reap_group(driver)


def test_metrics_over_mutual_tls(pair, tmp_path):
    """HTTPS with scrapers' certificates: a scraper with one of the CA's gets the metrics, others not."""
    import ssl

    from sluicegate.workflow.metrics import MetricsServer

    from .tlscerts import TestCA

    ca = TestCA(tmp_path / "ca")
    server_cert, scraper = ca.issue("metrics", ips=("127.0.0.1",)), ca.issue("prometheus", client=True)
    server = MetricsServer(pair.target, "wf", 0, "127.0.0.1", cert_file=str(server_cert.cert),
                           key_file=str(server_cert.key), client_ca_file=str(ca.path))
    try:
        url = f"https://127.0.0.1:{server.port}/metrics"
        context = ssl.create_default_context(cafile=str(ca.path))
        context.load_cert_chain(str(scraper.cert), str(scraper.key))
        with urllib.request.urlopen(url, context=context, timeout=30) as resp:
            assert resp.status == 200 and "sluicegate_target_up{workflow=\"wf\"}" in resp.read().decode()
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, context=ssl.create_default_context(cafile=str(ca.path)), timeout=30).read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30).read()
    finally:
        server.stop()
