"""The driver of a Reshard's streams: every stream's final state reaches the caller, its own."""

from __future__ import annotations

import threading

from sluicegate.workflow.reshard import run_engines


class Stream:
    """What run_engines needs of an Engine: run() to a final state (or an exception), then close()."""

    def __init__(self, stream_id: int, final: str | Exception, started: threading.Barrier):
        self.stream_id, self.final, self.started, self.closed = stream_id, final, started, False

    def run(self) -> str:
        self.started.wait(timeout=10)  # every stream runs at once, as on a driver
        if isinstance(self.final, Exception):
            raise self.final
        return self.final

    def close(self) -> None:
        self.closed = True


def test_each_target_shards_stream_keeps_its_own_final_state():
    # Two target shards, each numbering its streams from 1: the same ids, different outcomes
    outcomes = ["Stopped", RuntimeError("copy failed"), "Stopped", "Stopped"]
    started = threading.Barrier(len(outcomes))
    streams = [Stream(sid, final, started) for sid, final in zip((1, 2, 1, 2), outcomes)]
    assert run_engines(streams) == ["Stopped", "Error: copy failed", "Stopped", "Stopped"]
    assert all(s.closed for s in streams)
