"""Sluicegate: consistent, resumable PostgreSQL table replication on Apache Spark."""

__version__ = "0.1.0"
