"""The VStream server with TLS and client authentication: mutual TLS and a bearer token. A client without the
right certificate or token is refused (and never reaches the source), one with it streams rows, through the
Python client and the CLI; a server off loopback without TLS and authentication is refused unless --insecure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from sluicegate.changes import change_pb2 as pb
from sluicegate.changes import change_pb2_grpc as pb_grpc
from sluicegate.changes import model as m
from sluicegate.errors import UsageError
from sluicegate.vstream import ClientSecurity, ServerSecurity, VStreamServer, client
from sluicegate.vstream.security import TOKEN_ENV, load_token

from .tlscerts import TestCA


@pytest.fixture
def pki(tmp_path):
    """(CA, server certificate for 127.0.0.1, a client certificate of the CA's, one of another CA's)."""
    ca, stranger = TestCA(tmp_path / "ca"), TestCA(tmp_path / "stranger", "stranger")
    return (ca, ca.issue("vstream", ips=("127.0.0.1",)), ca.issue("reader", client=True),
            stranger.issue("intruder", client=True))


def refusal(address: str, security: ClientSecurity) -> grpc.StatusCode | None:
    """The status code a Stream call with `security` ends with (None: it was served)."""
    with security.channel(address, []) as channel:
        call = pb_grpc.VStreamStub(channel).Stream(pb.VStreamRequest(client_id="refused"),
                                                   metadata=security.metadata, timeout=15)
        try:
            next(iter(call))
        except grpc.RpcError as exc:
            return exc.code()
        call.cancel()
        return None


def slots(pair) -> int:
    return pair.src("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")[0][0]


def first_rows(pair, address: str, security: ClientSecurity, client_id: str) -> list:
    """The rows of the first transaction the client gets, after an INSERT made once it is connected."""
    events = client.stream(address, client_id, security=security)
    try:
        it = iter(events)
        assert not isinstance(next(it), m.Transaction)  # a heartbeat: connected, its slot is made
        pair.src("INSERT INTO a VALUES (1, 'one'), (2, 'two')")
        deadline = time.monotonic() + 60
        for ev in it:
            if isinstance(ev, m.Transaction):
                events.ack()
                return [r["after"] for r in m.to_json(ev)["statements"][0]["rows"]]
            assert time.monotonic() < deadline, "no transaction"
    finally:
        events.close()
    raise AssertionError("the stream ended")


def test_mutual_tls(pair, pki):
    ca, server_cert, reader, intruder = pki
    pair.src("CREATE TABLE a (id int PRIMARY KEY, v text)")
    security = ServerSecurity(str(server_cert.cert), str(server_cert.key), client_ca_file=str(ca.path))
    with VStreamServer(pair.source, security=security, heartbeat_seconds=0.2) as srv:
        # No client certificate, one of another CA, no TLS at all: the handshake fails.
        for who in (ClientSecurity(ca_file=str(ca.path)),
                    ClientSecurity(str(ca.path), str(intruder.cert), str(intruder.key)),
                    ClientSecurity()):
            assert refusal(srv.address, who) == grpc.StatusCode.UNAVAILABLE, who
        assert slots(pair) == 0  # none of them reached the source
        ok = ClientSecurity(str(ca.path), str(reader.cert), str(reader.key))
        assert first_rows(pair, srv.address, ok, "mtls") == [{"id": "1", "v": "one"}, {"id": "2", "v": "two"}]


def test_token(pair, pki, tmp_path, monkeypatch):
    ca, server_cert, _, _ = pki
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-" + os.urandom(8).hex() + "\n")
    pair.src("CREATE TABLE a (id int PRIMARY KEY, v text)")
    security = ServerSecurity(str(server_cert.cert), str(server_cert.key), token=load_token(str(token_file)))
    with VStreamServer(pair.source, security=security, heartbeat_seconds=0.2) as srv:
        tls = str(ca.path)
        assert refusal(srv.address, ClientSecurity(tls)) == grpc.StatusCode.UNAUTHENTICATED
        assert refusal(srv.address, ClientSecurity(tls, token="guess")) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(UsageError, match="UNAUTHENTICATED.*--token-file"):
            next(iter(client.stream(srv.address, "nobody", security=ClientSecurity(tls))))
        assert slots(pair) == 0
        monkeypatch.setenv(TOKEN_ENV, token_file.read_text().strip())  # the environment's token
        assert first_rows(pair, srv.address, ClientSecurity(tls, token=load_token(None)), "tok") == [
            {"id": "1", "v": "one"}, {"id": "2", "v": "two"}]
        monkeypatch.delenv(TOKEN_ENV)

        # The CLI client: --ca-file and --token-file; it resumes client "tok" after its acknowledgement.
        pair.src("INSERT INTO a VALUES (3, 'three')")
        out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "vstream", "--server", srv.address,
                              "--client-id", "tok", "--ca-file", tls, "--token-file", str(token_file), "--json",
                              "--no-heartbeats", "--max-messages", "1"],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["statements"][0]["rows"][0]["after"] == {"id": "3", "v": "three"}
        out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "vstream", "--server", srv.address,
                              "--client-id", "tok", "--ca-file", tls, "--max-messages", "1"],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode != 0 and "UNAUTHENTICATED" in out.stderr and "Traceback" not in out.stderr


def test_serve_refuses_an_open_address(pair, pki):
    _, server_cert, _, _ = pki

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "vstream", "serve", "--source",
                               pair.source, "--port", "0", *args], capture_output=True, text=True, timeout=60,
                              check=False, env={k: v for k, v in os.environ.items() if k != TOKEN_ENV})

    out = serve("--host", "0.0.0.0")
    assert out.returncode != 0 and "without TLS and client authentication" in out.stderr, out.stderr
    assert "--cert-file" in out.stderr and "--insecure" in out.stderr
    out = serve("--host", "10.23.0.1", "--cert-file", str(server_cert.cert), "--key-file", str(server_cert.key))
    assert out.returncode != 0 and "without client authentication" in out.stderr and "--token-file" in out.stderr
    with pytest.raises(UsageError, match="--insecure"):
        VStreamServer(pair.source, host="0.0.0.0")
    # Told in so many words, it serves (on loopback here, where the test's port is free).
    with VStreamServer(pair.source, host="127.0.0.1", security=ServerSecurity(insecure=True)):
        pass
