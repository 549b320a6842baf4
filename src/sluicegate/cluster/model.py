"""The cluster model (a Replicate workflow's `options["cluster"]`) lives in workflow/cluster_model.py, where
the engine that dispatches on it can read it without importing cluster/; re-exported here for cluster/'s
modules and their callers."""

from ..workflow.cluster_model import KIND, Cluster, cluster_ids, direction, origin_name, slot_name, way_out

__all__ = ["KIND", "Cluster", "cluster_ids", "direction", "origin_name", "slot_name", "way_out"]
