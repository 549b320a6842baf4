"""The recorded pgoutput bytes (tests/fixtures/pgoutput/, made by tests/fixtures/record_pgoutput.py).

A recording is `pgNN_text.jsonl` or `pgNN_binary.jsonl`: a header line, the version marker (the server's
`server_version` and `server_version_num`, whether columns came in binary), then one message a line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pgoutput"
NAMES = sorted(p.stem for p in FIXTURES.glob("pg*_*.jsonl"))
MAJORS = sorted({int(re.match(r"pg(\d+)_", n).group(1)) for n in NAMES})


def read(name: str) -> tuple[dict, list[dict]]:
    """(header, messages) of a recording; each message {"lsn", "xid", "data": hex}."""
    with (FIXTURES / f"{name}.jsonl").open() as f:
        header, *rows = map(json.loads, f)
    assert "server_version_num" in header, f"{name}: the first line is the version marker"
    return header, rows
