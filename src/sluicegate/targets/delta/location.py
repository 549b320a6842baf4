"""Where a Delta target lives: `delta:PATH`, PATH a local directory or a URI delta-rs supports.

One parse for every module: the root as delta-rs takes it (a local absolute path, or `scheme://...`), and a
pyarrow filesystem for the files sluicegate writes and reads itself (copy files, consistent reads). `file://`
is local. Credentials are never part of the location: delta-rs and pyarrow read them from the environment
(AWS_*, AZURE_*, GOOGLE_*), on the driver and on every Spark executor, so nothing stored or printed holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from ...errors import RetryableError, UsageError

PREFIX = "delta:"
# Schemes delta-rs 1.x opens (object_store) and pyarrow can read and write too.
REMOTE = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure", "adl"}
WAY_OUT = "use a local directory, s3://, gs:// or abfss:// (credentials in the AWS_*/GOOGLE_*/AZURE_* environment)"


def is_delta(target: str | None) -> bool:
    """A Delta target or sink (`delta:PATH`), as the sinks' lists and --target spell it."""
    return bool(target) and target.startswith(PREFIX)


@dataclass(frozen=True)
class Location:
    uri: str  # a local absolute path (no scheme), or scheme://bucket/path without a trailing slash

    @property
    def local(self) -> bool:
        return "://" not in self.uri

    @property
    def scheme(self) -> str:
        return "" if self.local else self.uri.split("://", 1)[0].lower()

    @property
    def target(self) -> str:
        return PREFIX + self.uri

    def join(self, *parts: str) -> str:
        return "/".join([self.uri.rstrip("/"), *(p.strip("/") for p in parts if p.strip("/"))])

    def table(self, schema: str, name: str) -> str:
        """The URI of the Delta table of schema.name: ROOT/<schema>/<name>."""
        return self.join(schema, name)


def filesystem(uri: str):
    """(pyarrow filesystem, path on it) of a local path or a URI."""
    import pyarrow.fs as pafs

    if "://" not in uri:
        return pafs.LocalFileSystem(), uri
    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors vary by scheme and cause
        import pyarrow as pa

        scheme = uri.split("://", 1)[0]
        why = str(exc).splitlines()[0][:300]
        if isinstance(exc, pa.ArrowNotImplementedError) or "nrecognized filesystem" in why:
            raise UsageError(f"target {uri}: pyarrow cannot open {scheme}:// here ({why}); {WAY_OUT}") from None
        raise RetryableError(f"{uri}: cannot reach the store ({why}); check its address and the credentials in "
                             f"the environment") from None


def parse(target: str | Path) -> Location:
    """`delta:PATH`, PATH, `file://PATH` or `scheme://...` as a Location."""
    raw = str(target).removeprefix(PREFIX).strip()
    if raw.startswith("file://"):
        raw = raw.removeprefix("file://")
    if not raw:
        raise UsageError("target delta: names no directory: delta:/path/to/lake or delta:s3://bucket/lake")
    if "://" not in raw:
        return Location(str(Path(raw).expanduser().resolve()))
    scheme, _, rest = raw.partition("://")
    scheme = scheme.lower()
    if scheme == "memory":
        raise UsageError(f"target {target}: memory:// lives in one process, and a workflow's driver, tasks and "
                         f"commands are several; {WAY_OUT}")
    if scheme not in REMOTE:
        raise UsageError(f"target {target}: scheme {scheme}:// is not one sluicegate writes a Delta target to; "
                         f"{WAY_OUT}")
    rest = rest.rstrip("/")
    if not rest:
        raise UsageError(f"target {target} names no bucket: delta:{scheme}://bucket/lake")
    return Location(f"{scheme}://{rest}")


def file_uris(dt) -> list[str]:
    """The live files of a DeltaTable's version: local paths decoded (delta-rs gives them percent-encoded,
    'public.Order%20Items/part-…', a name no file has), URIs as they are (filesystem_paths decodes them)."""
    return [u if "://" in u else unquote(u) for u in dt.file_uris()]


def filesystem_paths(uris: list[str]):
    """(pyarrow filesystem, paths on it) of file URIs (or local paths) of one store."""
    fs, first = filesystem(uris[0] if uris else "")  # (none: the local one)
    if not uris or "://" not in uris[0]:
        return fs, list(uris)
    if uris[0].split("://", 1)[0].lower() in ("s3", "s3a", "gs", "gcs"):
        # bucket/key, decoded: what from_uri gives, without a client each
        return fs, [unquote(u.split("://", 1)[1]) for u in uris]
    return fs, [first, *(filesystem(u)[1] for u in uris[1:])]
