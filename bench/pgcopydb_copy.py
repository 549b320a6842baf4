"""pgcopydb as a third copier in the copy benches (issue 37): `pgcopydb clone` of chosen tables.

`clone` is the command that does what Sluicegate's copy does: it makes the target tables (pg_dump's pre-data,
as `movetables create` does), copies the rows with parallel COPY from one exported snapshot, then builds the
indexes and adds the primary keys (`--index-jobs` at once). It also runs VACUUM ANALYZE on each copied table
beside the index builds, which Sluicegate does not (pgcopydb 0.10 has no option to skip it), and restores the
post-data section and sequences. `copy table-data` alone would leave out the key, `copy indexes` is a second
pass over the same catalog: clone is one command timed from start to exit, as Sluicegate's create + run.

PLATFORM.md: run it as user `postgres` (as root: the servers' account). Its work directory and filters file
are handed to that account; the password comes from PGPASSWORD (not on the command line).
"""
from __future__ import annotations

import os
import pwd
import shlex
import subprocess
import time
from pathlib import Path

PGCOPYDB = "/usr/bin/pgcopydb"


def account() -> pwd.struct_passwd | None:
    """Whom to run pgcopydb as: None (ourselves) unless root."""
    if os.geteuid() != 0:
        return None
    return pwd.getpwnam("postgres")


def clone(source_url: str, target_url: str, password: str, workdir: Path, *, tables: list[str] | None = None,
          jobs: int = 2, split_larger_than: str | None = None, timeout: float = 1800) -> dict:
    """`pgcopydb clone` from source_url to target_url (URLs without a password; an existing, empty target
    database). `tables`: "schema.table" names to copy (a filters file's include-only-table), else every table.
    `split_larger_than`: pgcopydb's same-table concurrency threshold (e.g. "100MB"), else one COPY a table.
    Returns the wall seconds, the command line (as the README quotes it) and the log's path."""
    workdir.mkdir(parents=True, exist_ok=True)
    acct = account()
    cmd = [PGCOPYDB, "clone", "--source", source_url, "--target", target_url, "--dir", str(workdir / "work"),
           "--table-jobs", str(jobs), "--index-jobs", str(jobs), "--no-owner", "--no-acl"]
    if split_larger_than:
        cmd += ["--split-tables-larger-than", split_larger_than]
    if tables:
        filters = workdir / "filters.ini"
        filters.write_text("[include-only-table]\n" + "".join(f"{t}\n" for t in tables))
        cmd += ["--filters", str(filters)]
    logfile = workdir / "pgcopydb.log"
    if acct:
        for path in (workdir, *workdir.iterdir()):
            os.chown(path, acct.pw_uid, acct.pw_gid)
        for parent in workdir.parents:  # let the account traverse root's 0700 temp dirs (o+x lists nothing)
            st = parent.stat()
            if st.st_uid != acct.pw_uid and not st.st_mode & 0o001:
                parent.chmod(st.st_mode | 0o001)
    kw = {"user": acct.pw_uid, "group": acct.pw_gid, "extra_groups": []} if acct else {}
    env = {**os.environ, "PGPASSWORD": password, "HOME": acct.pw_dir if acct else os.environ.get("HOME", "/")}
    env.pop("PGPASSFILE", None)  # root's pgpass file is not readable by the account
    if acct:  # root's PATH has directories the account may not search (pgcopydb logs an error for each)
        env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
    with open(logfile, "w") as out:
        t = time.monotonic()
        proc = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=env, cwd=str(workdir), timeout=timeout, **kw)
        elapsed = time.monotonic() - t
    if proc.returncode:
        tail = " | ".join(logfile.read_text(errors="replace").strip().splitlines()[-6:])
        raise RuntimeError(f"pgcopydb clone exited {proc.returncode}: {tail}")
    return {"seconds": elapsed, "command": shlex.join(cmd), "log": str(logfile)}
