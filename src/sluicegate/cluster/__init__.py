"""Cluster replication (YugabyteDB 2DC): one source cluster feeding one or more sink clusters.

A *cluster* here is one PostgreSQL database; a *sink* is a database that consumes the source's changes with
its own checkpoints (its own `sluicegate` schema, one stream per source) and its own slot and publication on
the source, so a slow, stopped or unreachable sink never holds up another. The data path is MoveTables's
(copy -> catchup -> fast-forward -> replicate). Around it this package adds what a long-lived replica needs:

- model.py      (re-exports workflow/cluster_model.py) the workflow's sinks and caps, as every sink records them
- create.py     `replicate create`: the checks, and the bootstrap decision for each sink and table
- keyspace.py   `replicate create --source-shard …`: a keyspace source, one stream per (sink, source shard)
- decisions.py  the seed's bootstrap chart for an existing setup: resume, or Error with the command
- bootstrap.py  `replicate bootstrap`: re-copy what cannot resume
- add_tables.py `replicate add-tables`: new tables joined to the running streams
- safetime.py   the source time up to which a sink has every committed transaction
- governor.py   caps on the WAL a lagging sink holds on the source, enforced by any sink's consumer
- sinks.py      sinks of other kinds (a Delta Lake directory, `--sink delta:PATH`, whose code is targets/delta/sink.py):
                the interface cluster/ calls them through, registered by their package
"""
