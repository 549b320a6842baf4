"""Named pause points for fault-injection tests (kill -9 at an exact phase). Inert unless enabled.

With SLUICEGATE_FAULT_PAUSE=<name> and SLUICEGATE_FAULT_DIR=<dir>, reaching the point creates
<dir>/<name> and waits there until the driver process (SLUICEGATE_DRIVER_PID) is gone, then exits
without committing anything — exactly what a kill -9 of the driver at that point leaves behind. The
test polls for the file, then kills the driver. A test that removes the file instead lets the process go
on from the point: a race with another command, forced to happen there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import config
from .procs import pid_alive


def fault_point(name: str) -> None:
    if config.from_env("fault_pause") != name:
        return
    directory = config.from_env("fault_dir")
    if not directory:
        return
    marker = Path(directory, name)
    marker.touch()
    driver = config.from_env("driver_pid")
    while marker.exists():  # the test kills the driver; a Spark worker then dies with it
        if driver and driver != os.getpid() and not pid_alive(driver):
            os._exit(137)
        time.sleep(0.05)
