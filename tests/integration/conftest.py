"""Fixtures of the cluster-replication tests."""

from __future__ import annotations

import pytest

from .cluster_helpers import cluster


@pytest.fixture
def rc(source_server, target_server, sink_server):
    """A source and two sinks (on the target and sink servers): fresh databases for one test."""
    with cluster(source_server, target_server, sink_server) as c:
        yield c
