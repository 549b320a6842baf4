"""Prometheus metrics of `workflow run --metrics-port N`.

What the state says (lag, position, rows copied and applied, batches) is read from the target at each scrape,
as status reads it: the target holds the truth, the metrics keep no second copy. Only what the state does not
record, the engine's retries and errors, is counted in this process (`count`). prometheus-client is imported
when metrics are served: the engine counts without it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from ..errors import UsageError
from ..listen import check_listen, read_file
from ..postgres.connect import describe

log = logging.getLogger("sluicegate.metrics")

_lock = threading.Lock()
_counts: Counter = Counter()  # (metric, workflow, target, stream id) -> n


def count(metric: str, workflow: str, target_url: str, stream_id: int) -> None:
    """One more retry or error (metric "retries" or "errors") of a stream (its id is unique on its target)."""
    with _lock:
        _counts[(metric, workflow, describe(target_url), stream_id)] += 1


def counted(metric: str, workflow: str, target_url: str, stream_id: int) -> int:
    with _lock:
        return _counts[(metric, workflow, describe(target_url), stream_id)]


# Per stream: (name, as sluicegate_NAME; a counter?; help; labels past the stream's), in the order served.
_STREAM_METRICS = [
    ("stream_state", False, "1 for the stream's current state (Init, Copying, Running, Stopped, Error).",
     ["state"]),
    ("lag_seconds", False, "How far the target is behind the source (streams that replicate).", []),
    ("applied_position_bytes", False, "The source position (LSN, in bytes) applied on the target.", []),
    ("retained_wal_bytes", False, "WAL the stream's replication slot holds on its source.", []),
    ("rows_copied", True, "Rows copied into the target, per table.", ["table"]),
    ("table_rows_estimated", False, "The table's rows as the source estimates them (or copied, if more).",
     ["table"]),
    ("table_copied", False, "1 once the table's copy is done.", ["table"]),
    ("rows_applied", True,
     "Rows replayed into the target from the source's changes (catchup, fast-forward, replicate).", []),
    ("batches", True, "Replay batches committed on the target.", []),
    ("retries", True, "Retryable failures this driver retried.", []),
    ("errors", True, "Failures that put a stream in Error in this driver.", []),
]


class WorkflowCollector:
    """Reads workflow `name`'s state from its target(s) at each scrape (a custom collector: prometheus-client
    calls `collect`)."""

    def __init__(self, target_url: str, name: str):
        self.target_url, self.workflow = target_url, name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily("sluicegate_driver_up",
                               "1 while this workflow's driver (workflow run) serves these metrics.",
                               labels=["workflow"])
        up.add_metric([self.workflow], 1)
        target_up = GaugeMetricFamily(
            "sluicegate_target_up", "1 if the workflow's state could be read from its target at this scrape.",
            labels=["workflow"])
        try:
            streams = self._streams()
        except Exception as exc:  # noqa: BLE001 - the target may be restarting: say so, serve the rest
            log.debug("metrics: could not read workflow %s: %s", self.workflow, exc)
            target_up.add_metric([self.workflow], 0)
            yield from (up, target_up)
            return
        target_up.add_metric([self.workflow], 1)
        m = {name: (CounterMetricFamily if counter else GaugeMetricFamily)(
                 f"sluicegate_{name}", doc, labels=["workflow", "stream", "source", *more])
             for name, counter, doc, more in _STREAM_METRICS}
        for s in streams:
            labels = [self.workflow, s["stream"], s["source"]]
            m["stream_state"].add_metric([*labels, s["state"]], 1)
            for name, value in (("lag_seconds", s["lag_seconds"]),
                                ("applied_position_bytes", s["position_bytes"]),
                                ("retained_wal_bytes", s.get("retained_wal_bytes"))):
                if value is not None:
                    m[name].add_metric(labels, value)
            for t in s["tables"]:
                m["rows_copied"].add_metric([*labels, t["table"]], t["rows_copied"])
                m["table_rows_estimated"].add_metric([*labels, t["table"]], t["rows_total"])
                m["table_copied"].add_metric([*labels, t["table"]], 1 if t["state"] == "Copied" else 0)
            for name in ("rows_applied", "batches"):
                m[name].add_metric(labels, s[name])
            for name in ("retries", "errors"):
                m[name].add_metric(labels, counted(name, self.workflow, s["target"], s["id"]))
        yield from (up, target_up, *m.values())

    def _streams(self) -> list[dict]:
        from .shards import load_all
        from .status import slot_facts, workflow_status

        streams = []
        for shard, url, wf in load_all(self.workflow, self.target_url):
            status = workflow_status(wf, slots=slot_facts(wf))
            by_id = {s.id: s for s in wf.streams}
            for s in status["streams"]:
                stream = by_id[s["id"]]
                # A Reshard's target shards number their streams each from 1: the shard tells them apart.
                streams.append(
                    {
                        **s,
                        "stream": f"{shard}/{s['id']}" if shard else str(s["id"]),
                        "target": url,
                        "source": describe(stream.source_url),
                        "position_bytes": stream.position,
                        "rows_applied": stream.rows_applied,
                        "batches": stream.batches,
                    }
                )
        return streams


def check_metrics_listen(addr: str, cert_file: str | None, key_file: str | None, client_ca_file: str | None,
                         insecure: bool) -> None:
    if (cert_file is None) != (key_file is None):
        raise UsageError("--metrics-cert-file and --metrics-key-file go together: the certificate and its key")
    if client_ca_file and not cert_file:
        raise UsageError("--metrics-client-ca-file needs TLS: give --metrics-cert-file and --metrics-key-file too")
    check_listen("the metrics endpoint", addr, tls=cert_file is not None, auth=client_ca_file is not None,
                 insecure=insecure, tls_flags="--metrics-cert-file and --metrics-key-file",
                 auth_flags="--metrics-client-ca-file (scrapers' certificates)", insecure_flag="--metrics-insecure")


class MetricsServer:
    """/metrics over HTTP on addr:port, in a thread of its own, until `stop`."""

    def __init__(self, target_url: str, name: str, port: int, addr: str = "127.0.0.1", *,
                 cert_file: str | None = None, key_file: str | None = None, client_ca_file: str | None = None,
                 insecure: bool = False):
        """`cert_file`/`key_file`: HTTPS; `client_ca_file`: only scrapers with a certificate it signed. Off
        loopback both are required, unless `insecure`."""
        check_metrics_listen(addr, cert_file, key_file, client_ca_file, insecure)
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(WorkflowCollector(target_url, name))
        for path, flag in ((cert_file, "--metrics-cert-file"), (key_file, "--metrics-key-file"),
                           (client_ca_file, "--metrics-client-ca-file")):
            read_file(path, flag)  # a missing file named by its flag, not an ssl traceback
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry,
                                                       certfile=cert_file, keyfile=key_file,
                                                       client_cafile=client_ca_file,
                                                       client_auth_required=client_ca_file is not None)
        self.port = self._server.server_port
        log.info("serving metrics at %s://%s:%d/metrics", "https" if cert_file else "http", addr, self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
