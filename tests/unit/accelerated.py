"""C accelerators and their Python fallbacks, both under test."""

from __future__ import annotations

import pytest


def c_or_python(request, monkeypatch, module, name: str) -> str:
    """For a fixture parametrized ["c", "python"]: the test runs on the C version `module.<name>`, then on the
    Python path it falls back to (the name set to None); skipped in C where the extension is not built."""
    if request.param == "python":
        monkeypatch.setattr(module, name, None)
    elif getattr(module, name) is None:
        pytest.skip("the C extension is not built")
    return request.param
