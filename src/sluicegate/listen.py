"""Where Sluicegate's own servers (VStream, metrics) may listen: loopback freely; any other address hands data
to whoever reaches the port, so only with TLS and client authentication, or when told `--insecure`."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from .errors import UsageError


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; anything else (0.0.0.0, a name) may be reachable from elsewhere."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(what: str, host: str, *, tls: bool, auth: bool, insecure: bool, tls_flags: str,
                 auth_flags: str, insecure_flag: str = "--insecure") -> None:
    """Refuse a non-loopback `host` without TLS and client authentication, unless `insecure`."""
    if insecure or is_loopback(host) or (tls and auth):
        return
    missing = " and ".join(x for x, have in (("TLS", tls), ("client authentication", auth)) if not have)
    need = " and ".join(flags for flags, have in ((tls_flags, tls), (auth_flags, auth)) if not have)
    raise UsageError(f"{what} on {host} would serve anyone who reaches it, without {missing}: give {need}, "
                     f"or say {insecure_flag} to serve it so anyway (or listen on 127.0.0.1)")


def read_file(path: str | Path | None, what: str) -> bytes | None:
    """The bytes of a certificate, key or token file (None: not given), or a UsageError naming the flag."""
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}") from None
