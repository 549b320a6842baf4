"""Where Sluicegate's servers may listen: loopback freely; elsewhere with TLS and client authentication, or
when told --insecure. Checked before anything binds or connects (no server here)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from sluicegate.cli.main import cli
from sluicegate.errors import UsageError
from sluicegate.listen import check_listen, is_loopback
from sluicegate.vstream.security import TOKEN_ENV, ServerSecurity, TokenInterceptor, load_token
from sluicegate.workflow.metrics import check_metrics_listen


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True),
                                                ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                                ("::", False), ("10.1.2.3", False), ("db.example", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_the_rule():
    kw = {"tls_flags": "--cert", "auth_flags": "--token"}
    for tls, auth, insecure in [(True, True, False), (False, False, True)]:
        check_listen("x", "0.0.0.0", tls=tls, auth=auth, insecure=insecure, **kw)
    check_listen("x", "127.0.0.1", tls=False, auth=False, insecure=False, **kw)
    with pytest.raises(UsageError, match="without TLS and client authentication: give --cert and --token, or "
                                         "say --insecure"):
        check_listen("x", "10.0.0.1", tls=False, auth=False, insecure=False, **kw)
    with pytest.raises(UsageError, match="without client authentication: give --token,"):
        check_listen("x", "0.0.0.0", tls=True, auth=False, insecure=False, **kw)
    with pytest.raises(UsageError, match="without TLS: give --cert,"):
        check_listen("x", "0.0.0.0", tls=False, auth=True, insecure=False, **kw)


def test_vstream_server_security(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(UsageError, match="--cert-file and --key-file.*--client-ca-file or --token-file.*"
                                         "--insecure"):
        ServerSecurity().check("0.0.0.0")
    with pytest.raises(UsageError, match="go together"):
        ServerSecurity(cert_file="c").check("127.0.0.1")
    ServerSecurity("c", "k", token="t").check("0.0.0.0")
    ServerSecurity("c", "k", client_ca_file="ca").check("10.0.0.1")
    ServerSecurity(insecure=True).check("0.0.0.0")
    # tokens: a file's first line, else the environment; never an argument
    (tmp_path / "t").write_text("  abc \nignored\n")
    assert load_token(str(tmp_path / "t")) == "abc"
    assert load_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert load_token(None) == "from-env"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UsageError, match="is empty"):
        load_token(str(tmp_path / "empty"))
    with pytest.raises(UsageError, match="cannot read --token-file"):
        load_token(str(tmp_path / "missing"))


class _Details:
    def __init__(self, metadata):
        self.invocation_metadata = metadata


def test_token_interceptor():
    passed = object()
    check = TokenInterceptor("abc").intercept_service
    assert check(lambda d: passed, _Details((("authorization", "Bearer abc"),))) is passed
    for metadata in [(), (("authorization", "Bearer abd"),), (("authorization", "abc"),), None]:
        assert check(lambda d: passed, _Details(metadata)) is not passed


def test_metrics_rule_and_the_cli_refusal():
    check_metrics_listen("127.0.0.1", None, None, None, False)
    check_metrics_listen("0.0.0.0", None, None, None, True)
    check_metrics_listen("0.0.0.0", "c", "k", "ca", False)
    with pytest.raises(UsageError, match="--metrics-client-ca-file"):
        check_metrics_listen("0.0.0.0", "c", "k", None, False)
    # `workflow run` refuses before it connects anywhere (the target here does not exist)
    out = CliRunner().invoke(cli, ["workflow", "run", "w", "--target", "postgresql://nowhere.invalid/x",
                                   "--metrics-port", "0", "--metrics-addr", "0.0.0.0"])
    assert out.exit_code == 1 and "--metrics-cert-file" in out.output and "--metrics-insecure" in out.output, \
        out.output
    out = CliRunner().invoke(cli, ["vstream", "serve", "--source", "postgresql://nowhere.invalid/x", "--port",
                                   "0", "--host", "10.9.8.7"])
    assert out.exit_code == 1 and "--client-ca-file" in out.output and "--insecure" in out.output, out.output
