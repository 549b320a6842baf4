"""Every setting Sluicegate reads, declared once: its name, type, default, meaning, and where it may come from.

Three sources, in increasing precedence: the declared default ← the environment (`SLUICEGATE_*`) ← a flag on
the command line or a key of the workflow's options (`sluicegate.workflows.options`, written at create and by
`workflow set`). Nothing reads `os.environ` for a `SLUICEGATE_*` variable or picks a key out of a workflow's
options without it being declared here, so a misspelt key is an error naming the closest known one instead of
a setting silently left at its default.

Besides the settings a user chooses, a workflow's options also hold records the code keeps there (traffic
state, the cluster of a Replicate workflow, pending foreign keys...): they are declared too (RECORD), so that a
workflow the code wrote always loads. INTERNAL names are for Sluicegate itself and its tests (fault points).

Standard library only: the command line, the engine and every Spark worker import this module.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import SluicegateError, TerminalError, UsageError

# Where a setting may come from.
OPTION, ENV, FLAG = "workflow option", "environment", "flag"
# What a setting is: chosen by a user, a record the code keeps in a workflow's options, or internal.
USER, RECORD, INTERNAL = "user", "record", "internal"


@dataclass(frozen=True)
class Setting:
    name: str  # the key in a workflow's options, and the name code asks for
    type: str  # int, float, bool, str, size (bytes, "1GB"), json (a record's structure)
    default: Any
    doc: str  # one line: what it means
    option: bool = False  # may be a key of a workflow's options
    env: str | None = None  # the SLUICEGATE_* variable that may give it
    flag: str | None = None  # the command-line flag that may give it
    kind: str = USER
    tunable: bool = False  # an existing workflow's may be changed (`workflow set W KEY=VALUE`); above zero

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(s for s, on in ((OPTION, self.option), (ENV, self.env), (FLAG, self.flag)) if on)


def _opt(name, type_, default, doc, flag=None, tunable=False) -> Setting:
    # What a user may change on an existing workflow is a number whose next copy cycle or play task simply
    # works to the new value; a tunable number must be above zero.
    return Setting(name, type_, default, doc, option=True, flag=flag, tunable=tunable)


def _env(name, type_, default, doc, flag=None, kind=USER) -> Setting:
    return Setting(name, type_, default, doc, env=f"SLUICEGATE_{name.upper()}", flag=flag, kind=kind)


def _record(name, doc) -> Setting:
    return Setting(name, "json", None, doc, option=True, kind=RECORD)


SETTINGS: tuple[Setting, ...] = (
    # -- a workflow's settings (its options) ------------------------------------------------------------------
    # Vitess copies for up to an hour before it catches up; a much shorter cycle here keeps each catchup small
    # and the snapshot short.
    _opt("cycle_rows", "int", 10_000_000, "rows per copy cycle (one snapshot; catchup and fast-forward between)",
         "--cycle-rows", tunable=True),
    # Whole waves of tasks: up to twice this (copier._tasks). Each task opens two sessions and imports the
    # snapshot; bigger tasks spend less on that.
    _opt("chunk_rows", "int", 1_000_000, "rows per Spark copy task, about", "--chunk-rows", tunable=True),
    _opt("batch_changes", "int", 20_000, "pgoutput messages per replay batch", tunable=True),
    # None: a workflow with one stream plays until interrupted; streams sharing the executors use
    # engine.SHARED_SLICE_SECONDS.
    _opt("slice_seconds", "float", None, "how long a play task runs before the driver re-reads state (none: "
                                         "until interrupted, or a shared slice)", tunable=True),
    _opt("idle_poll", "float", 0.1, "seconds a play task waits for changes when the source is quiet",
         tunable=True),
    # One sorted build costs less than maintaining the indexes row by row during COPY (postgres/indexes.py).
    _opt("defer_indexes", "bool", True, "drop a target table's indexes before its first copy cycle, build them "
                                        "after (--keep-indexes: false)", "--keep-indexes"),
    _opt("confirm_after_target_standbys", "bool", False, "confirm a source position only once the target's "
                                                         "standbys flushed it", "--confirm-after-target-standbys"),
    _opt("on_ddl", "str", "stop", "what a stream does with a captured DDL statement: stop, ignore, exec, "
                                  "exec-ignore", "--on-ddl"),
    _opt("stage_rows", "int", 50_000, "a Delta target: changes a batch holds in memory before staging them",
         tunable=True),
    # Rows may be wide (a TOASTed document is sent whole): bytes bound what a batch holds as well as changes.
    _opt("stage_bytes", "size", 64 << 20, "a Delta target: bytes of changes (as the source sends them) a batch "
                                         "holds in memory before staging them", tunable=True),
    _opt("commit_every", "float", 30.0, "a Delta target: least seconds between two commits of changes",
         "--commit-every"),
    _opt("optimize_every", "float", 300.0, "a Delta target: seconds between compactions (0: never)",
         "--optimize-every"),
    _opt("vacuum_every", "float", 30.0, "a Delta target: seconds between vacuums (0: never)", "--vacuum-every"),
    _opt("vacuum_retention", "float", 60.0, "a Delta target: seconds the scheduled vacuum keeps old versions",
         "--vacuum-retention"),
    # -- records the code keeps in a workflow's options ----------------------------------------------------------
    _record("cluster", "a Replicate workflow's clusters, sinks and caps (cluster/model.py)"),
    _record("keyspace", "a Reshard workflow's shards (workflow/reshard.py)"),
    _record("target_shard", "the key range of this Reshard target shard"),
    # Older versions kept a MoveTables' traffic here; now columns of sluicegate.workflows (state.set_traffic
    # moves them at the next switch). Declared so that such a workflow still loads.
    _record("traffic", "MoveTables traffic state: source, switched, reversed (older versions)"),
    _record("epoch", "the number of the last traffic switch (older versions)"),
    _record("position", "the source position of the last traffic switch (older versions)"),
    _record("reverse_of", "the forward workflow of a reverse workflow (older versions)"),
    _record("apply_as_replica", "apply with session_replication_role replica (triggers and keys off)"),
    _record("foreign_keys", "foreign keys to add once the copy is done (postgres/table_definition.py)"),
    _record("ddl_applied_by_hand", "per stream: the position of a DDL statement applied by hand (ddl/modes.py)"),
    _record("whole_schemas", "schemas moved whole: a table created in them joins (ddl/tables.py)"),
    _record("excluded_tables", "tables of those schemas left out at create (ddl/tables.py)"),
    # -- the environment --------------------------------------------------------------------------------------
    _env("target", "str", None, "libpq URL of the target database, or delta:PATH", "--target"),
    _env("spark_master", "str", None, "Spark master URL (else spark-defaults.conf's, else local[*])",
         "--spark-master"),
    _env("progress_interval", "float", 10.0, "seconds between progress lines of workflow run",
         "--progress-interval"),
    _env("wal_warning", "size", "1GB", "warn when a stream's slot holds more WAL than this", "--wal-warning"),
    # A controller (a vdiff taking its consistent point) holds a stream for a moment: one that held it longer
    # died; the driver then releases the stream (workflow/stream_control.py).
    _env("stream_hold_seconds", "float", 30.0, "seconds a stream may stay held by a vdiff before its driver "
                                               "releases it (PostgreSQL and Delta targets)"),
    _env("lock_timeout", "float", 3.0, "seconds every lock and DDL Sluicegate takes waits at most"),
    _env("vstream_token", "str", None, "the VStream bearer token, when no --token-file is given"),
    _env("copy_pump", "str", "", "python: copy through the Python pipe instead of the C row pump"),
    _env("spark_class_archive", "str", "", "path of the Spark class archive, or off"),
    _env("pg_bindir", "str", None, "PostgreSQL server binaries for local servers (demo, tests)"),
    _env("driver_pid", "int", 0, "the driver's process id, for the workers' fault points", kind=INTERNAL),
    _env("fault_pause", "str", None, "a fault point to pause at (tests)", kind=INTERNAL),
    _env("fault_dir", "str", None, "where a paused fault point leaves its marker file (tests)", kind=INTERNAL),
    _env("all_tests", "bool", False, "the test suite also runs its slow fault scenarios", kind=INTERNAL),
    _env("test_workers", "int", 2, "pytest workers scripts/test runs the suite in (0: one process)",
         kind=INTERNAL),
    _env("golden_update", "bool", False, "golden-file tests rewrite their expected output", kind=INTERNAL),
    _env("venv", "str", None, "the virtual environment scripts/ use", kind=INTERNAL),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
OPTION_NAMES: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.option)
TUNABLE_NAMES: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.tunable)
ENV_NAMES: tuple[str, ...] = tuple(s.env for s in SETTINGS if s.env)


def declared(name: str) -> Setting:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"setting {name!r} is not declared in sluicegate/config.py") from None


def env_var(name: str) -> str:
    """The SLUICEGATE_* variable of a setting (for click's envvar=, and for a child process's environment)."""
    var = declared(name).env
    if var is None:
        raise KeyError(f"setting {name!r} comes from no environment variable")
    return var


def default(name: str) -> Any:
    return declared(name).default


def from_env(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The setting as the environment gives it (parsed by its type), else its default. An empty variable is
    unset, as a shell's `VAR= command` means."""
    setting = declared(name)
    raw = (os.environ if environ is None else environ).get(env_var(name), "")
    if raw == "":
        return setting.default
    return parse(setting, raw, f"{setting.env}={raw}")


def resolve(name: str, given: Any = None, environ: Mapping[str, str] | None = None) -> Any:
    """defaults ← environment ← `given` (a flag's value, or a workflow option's): the first one set wins."""
    if given is not None:
        setting = declared(name)
        return parse(setting, given, f"{setting.flag or setting.name}={given}")
    return from_env(name, environ) if declared(name).env else default(name)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse(setting: Setting, value: Any, where: str, error: type[SluicegateError] = UsageError) -> Any:
    """`value` (a string from the environment or a flag, or a JSON value from options) as `setting.type`;
    `error` naming `where` when it is not one."""
    parsed = _parse(setting, value, where, error)
    if setting.tunable and parsed is not None and not 0 < parsed < math.inf:  # (nan is neither)
        raise error(f"{where}: must be above zero, and finite")
    return parsed


def _parse(setting: Setting, value: Any, where: str, error: type[SluicegateError]) -> Any:
    kind = setting.type
    if kind in ("json", "str") or value is None:
        if kind == "str" and not isinstance(value, str) and value is not None:
            raise error(f"{where}: not a string")
        return value
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise error(f"{where}: not a boolean (write one of {', '.join(_TRUE + _FALSE)})")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            if isinstance(value, str):
                return int(value.strip().replace("_", ""))
            if isinstance(value, float) and value.is_integer():
                return int(value)
        except ValueError:
            pass
        raise error(f"{where}: not an integer")
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            if isinstance(value, str):
                return float(value.strip())
        except ValueError:
            pass
        raise error(f"{where}: not a number")
    if kind == "size":
        from .sizes import parse_size

        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_size(str(value))
        except UsageError:
            raise error(f"{where}: not a size (write e.g. 1GB, 512MB or a number of bytes)") from None
    raise AssertionError(f"setting {setting.name}: unknown type {kind}")


def check_options(options: Mapping[str, Any], error: type[SluicegateError] = UsageError, where: str = "",
                  way_out: str = "") -> dict[str, Any]:
    """Every key of a workflow's options is declared, and a setting's value has its type; else `error`
    naming the key and the closest known one. `where`: what holds the options ("workflow W"); `way_out`: the
    message's tail. Returns the options parsed."""
    parsed = {}
    for key, value in options.items():
        setting = BY_NAME.get(key)
        if setting is None or not setting.option:
            raise error(unknown_message(key, OPTION_NAMES, where) + way_out)
        parsed[key] = parse(setting, value, f"{where + ': ' if where else ''}setting {key!r} = {value!r}", error)
    return parsed


# How an existing workflow's setting that is not tunable changes, if it does.
_CHANGED_BY = {"on_ddl": "`workflow set --on-ddl`",
               "confirm_after_target_standbys": "`workflow set --confirm-after-target-standbys`",
               **dict.fromkeys(("optimize_every", "vacuum_every", "vacuum_retention", "commit_every"),
                               "`sluicegate lake schedule`")}


def tuned(pairs: Mapping[str, str], where: str) -> dict[str, Any]:
    """`workflow set W KEY=VALUE ...`: the values parsed (None for `default`: the key goes, its default
    applies); UsageError for a key that is unknown or not one an existing workflow may change (`where`:
    "workflow W")."""
    out = {}
    for key, value in pairs.items():
        setting = BY_NAME.get(key)
        if setting is None or setting.kind != USER:
            raise UsageError(unknown_message(key, TUNABLE_NAMES, where))
        if not setting.tunable:
            how = f"changed by {_CHANGED_BY[key]}" if key in _CHANGED_BY else "chosen at create only"
            raise UsageError(f"{where}: {key} is {how}; KEY=VALUE changes {', '.join(TUNABLE_NAMES)}")
        out[key] = None if value.lower() == "default" else parse(setting, value, f"{where}: {key}={value}")
    return out


def unknown_message(key: str, known: tuple[str, ...], where: str = "") -> str:
    """"unknown setting 'cycle_row'; did you mean 'cycle_rows'?" (or the list of known ones)."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else \
        f"known: {', '.join(s for s in known if BY_NAME[s].kind == USER)}"
    return f"{where + ': ' if where else ''}unknown setting {key!r}; {hint}"


@dataclass(frozen=True)
class Settings:
    """A workflow's settings: each from its options, else its declared default (none comes from the
    environment today). The engine reads them every turn, so a changed option takes effect at the next."""

    cycle_rows: int = default("cycle_rows")
    chunk_rows: int = default("chunk_rows")
    batch_changes: int = default("batch_changes")
    slice_seconds: float | None = default("slice_seconds")
    idle_poll: float = default("idle_poll")
    defer_indexes: bool = default("defer_indexes")
    stage_rows: int = default("stage_rows")
    stage_bytes: int = default("stage_bytes")
    commit_every: float = default("commit_every")
    optimize_every: float = default("optimize_every")
    vacuum_every: float = default("vacuum_every")
    vacuum_retention: float = default("vacuum_retention")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str = "",
                     error: type[SluicegateError] = TerminalError) -> Settings:
        """Raises `error` (TerminalError: read inside a running workflow, where only the user can fix it) for
        a key that is not declared or a value of the wrong type."""
        way_out = "" if error is UsageError else (
            " (a key this version of Sluicegate does not know: run the workflow with the version that wrote it, "
            "or remove the key from the workflow's options)")
        given = check_options(options, error, where, way_out)
        return cls(**{f.name: given[f.name] if f.name in given else resolve(f.name) for f in fields(cls)})
