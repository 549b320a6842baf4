"""`sluicegate check`: before a workflow exists, prove that its run will have what it needs.

- (postgres/needs.py: the privileged calls the code makes, each with when a run makes it; the one list that
  `create`, `check` and the appliers' own error messages read, so it lives below all three)
- plan.py      a planned workflow (kind, clusters, options) and what it asks of each database: read as a
               source, apply as a target, both (bidirectional, or a MoveTables' reverse after switch-traffic)
- probes.py    the checks, one database at a time, each returning Problems with the SQL that fixes them
- report.py    the Problem type and its text and JSON forms
"""
