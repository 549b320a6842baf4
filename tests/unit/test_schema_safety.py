"""create's advice for key sequences of active-active tables (cluster/schema_safety.py): pure parts."""

from sluicegate.cluster.schema_safety import restarts


def test_restarts_clear_every_key_in_distinct_residue_classes():
    for high in (0, 1, 199, 200, 201, 10**12):
        for increment in (2, 3, 10):
            starts = restarts(high, increment)
            assert all(s > high for s in starts), (high, increment, starts)
            assert len({s % increment for s in starts}) == 2, (high, increment, starts)
            assert max(starts) - high <= 2 * increment  # no needless gap in the key space
    assert restarts(200, 2) == [203, 204]  # odd on the first side, even on the second
