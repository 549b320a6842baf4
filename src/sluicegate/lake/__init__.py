"""The public import path of the Delta target's consistent reads (README, "Delta Lake target"): readers'
code imports `sluicegate.lake.read`; the target itself lives in targets/delta/."""
