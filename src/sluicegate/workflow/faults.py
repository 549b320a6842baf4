"""Named pause points for fault-injection tests (kill -9 at an exact phase). Inert unless enabled.

With SLUICEGATE_FAULT_PAUSE=<name> and SLUICEGATE_FAULT_DIR=<dir>, reaching the point creates
<dir>/<name> and waits there until the driver process (SLUICEGATE_DRIVER_PID) is gone, then exits
without committing anything — exactly what a kill -9 of the driver at that point leaves behind. The
test polls for the file, then kills the driver.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def fault_point(name: str) -> None:
    if os.environ.get("SLUICEGATE_FAULT_PAUSE") != name:
        return
    directory = os.environ.get("SLUICEGATE_FAULT_DIR")
    if not directory:
        return
    Path(directory, name).touch()
    driver = int(os.environ.get("SLUICEGATE_DRIVER_PID", "0") or 0)
    while True:  # the test kills the driver; a Spark worker then dies with it
        if driver and driver != os.getpid() and not _alive(driver):
            os._exit(137)
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
