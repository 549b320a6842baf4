"""A Replicate whose source is a keyspace: slot names per (sink, shard), what the sinks record, the CLI's
choice between --source and --source-shard."""

from __future__ import annotations

from click.testing import CliRunner

from sluicegate.cli.main import cli
from sluicegate.cluster.model import Cluster, slot_name
from sluicegate.workflow import state as st

SINKS = {"s1": "postgresql://a/db", "s2": "postgresql://b/db"}
SHARDS = {"-80": "postgresql://src/ks0", "80-": "postgresql://src/ks1"}


def test_single_source_keeps_its_slot_names():
    c = Cluster("rp", "postgresql://src/db", SINKS, "s1")
    assert c.sources == {"0": "postgresql://src/db"}
    assert c.pairs() == [("s1", "0", "postgresql://src/db", slot_name("rp", "s1")),
                         ("s2", "0", "postgresql://src/db", slot_name("rp", "s2"))]
    assert "source_shards" not in c.to_json()


def test_keyspace_slot_per_sink_and_shard_survives_the_round_trip():
    c = Cluster("rp", SHARDS["-80"], SINKS, "s2", source_shards=SHARDS)
    slots = [p[3] for p in c.pairs()]
    assert len(set(slots)) == 4 and slots[0] == slot_name("rp", "s1/-80") == c.slot("s1", "-80")
    assert c.slot("s1", "-80") != c.slot("s1", "80-") != c.slot("s1")
    again = Cluster.of(st.Workflow("rp", "Replicate", SHARDS["-80"], {"cluster": c.to_json()}, []))
    assert again == c and again.sources == SHARDS


def _create(*args):
    result = CliRunner().invoke(cli, ["replicate", "create", "--workflow", "rp", "--sink", "postgresql://a/db",
                                      *args])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes is not None else "")


def test_exactly_one_kind_of_source():
    code, out = _create()
    assert code != 0 and "exactly one of the two" in out
    code, out = _create("--source", "postgresql://src/db", "--source-shard", "-=postgresql://src/db")
    assert code != 0 and "exactly one of the two" in out


def test_keyspace_options_that_do_not_apply():
    code, out = _create("--source", "postgresql://src/db", "--shard-key", "t=c")
    assert code != 0 and "goes with --source-shard" in out
    code, out = _create("--source-shard", "-=postgresql://src/db", "--bidirectional")
    assert code != 0 and "one way only" in out


def test_shards_must_cover_the_keyspace():
    code, out = _create("--source-shard", "-80=postgresql://src/ks0")
    assert code != 0 and "source shards must cover the keyspace" in out, out


def test_retention_age_is_refused_on_a_keyspace():
    from sluicegate.cluster.keyspace import create_keyspace_replicate
    from sluicegate.errors import UsageError

    try:
        create_keyspace_replicate("rp", SHARDS, ["postgresql://a/db"], None, None, {}, {}, max_retention_age=60.0)
    except UsageError as exc:
        assert "--max-retained-wal" in str(exc)
    else:
        raise AssertionError("--max-retention-age accepted on a keyspace source")
