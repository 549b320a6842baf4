"""Schema changes (DDL) captured on the source and replayed in the stream.

capture.py installs the source's event trigger that puts each DDL statement into the WAL as a transactional
logical message; message.py reads one; statement.py classifies its text; modes.py holds the workflow's
`--on-ddl` mode. A target's player replays it (workflow/ddl_replay.py, targets/delta/ddl.py).
"""
