"""Who may read a VStream server, which hands out every row of its source: TLS (a server certificate and key),
and client authentication by mutual TLS (client certificates signed by a CA the server trusts) and/or a
bearer token. Tokens come from a file or SLUICEGATE_VSTREAM_TOKEN, never from a command line (`ps` shows it)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import grpc

from .. import config
from ..errors import UsageError
from ..listen import check_listen, read_file

TOKEN_ENV = config.env_var("vstream_token")
_HEADER = "authorization"


def load_token(token_file: str | None) -> str | None:
    """The token of `token_file` (its first line), else of SLUICEGATE_VSTREAM_TOKEN, else None."""
    if token_file is not None:
        data = read_file(token_file, "--token-file")
        token = data.decode("utf-8", "replace").strip().splitlines()[0].strip() if data.strip() else ""
        if not token:
            raise UsageError(f"--token-file {token_file} is empty: write the token in it")
        return token
    return config.from_env("vstream_token") or None


@dataclass(frozen=True)
class ServerSecurity:
    """`cert_file`/`key_file`: TLS; `client_ca_file`: require client certificates it signed; `token`: require
    `authorization: Bearer <token>` on every call."""

    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None
    token: str | None = None
    insecure: bool = False

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    def check(self, host: str) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise UsageError("--cert-file and --key-file go together: the server's certificate and its key")
        if self.client_ca_file and not self.tls:
            raise UsageError("--client-ca-file needs TLS: give --cert-file and --key-file too")
        check_listen("the VStream server", host, tls=self.tls, auth=bool(self.client_ca_file or self.token),
                     insecure=self.insecure, tls_flags="--cert-file and --key-file",
                     auth_flags=f"--client-ca-file or --token-file (or {TOKEN_ENV})")

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        ca = read_file(self.client_ca_file, "--client-ca-file")
        return grpc.ssl_server_credentials([(read_file(self.key_file, "--key-file"),
                                             read_file(self.cert_file, "--cert-file"))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []


class TokenInterceptor(grpc.ServerInterceptor):
    """Every call must carry the token; others end with UNAUTHENTICATED before reaching the service."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(_HEADER, "")
        if hmac.compare_digest(given.encode(), self._expected):  # constant time: no guessing by timing
            return continuation(handler_call_details)
        return _REFUSE


def _refuse(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  "this VStream server needs a token: give the client --token-file or " + TOKEN_ENV)


_REFUSE = grpc.unary_unary_rpc_method_handler(_refuse)


@dataclass(frozen=True)
class ClientSecurity:
    """`ca_file`: verify the server's certificate (TLS); `cert_file`/`key_file`: the client's own, for
    mutual TLS; `token`: sent with every call."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None

    def channel(self, target: str, options: list) -> grpc.Channel:
        if (self.cert_file is None) != (self.key_file is None):
            raise UsageError("--cert-file and --key-file go together: the client's certificate and its key")
        if self.ca_file is None and self.cert_file is None:
            return grpc.insecure_channel(target, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=read_file(self.ca_file, "--ca-file"),
                                             private_key=read_file(self.key_file, "--key-file"),
                                             certificate_chain=read_file(self.cert_file, "--cert-file"))
        return grpc.secure_channel(target, creds, options=options)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Per call rather than grpc.metadata_call_credentials, which gRPC sends over TLS channels only: a
        # loopback server without TLS may still want a token.
        return ((_HEADER, f"Bearer {self.token}"),) if self.token else ()
