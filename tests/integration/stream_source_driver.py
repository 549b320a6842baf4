"""A streaming query over format("sluicegate") in its own process, for the kill -9 test of test_stream_source.

    python stream_source_driver.py SOURCE_URL SLOT CHECKPOINT OUT_JSONL MAX_BYTES first|resume

Each micro-batch's rows go to OUT_JSONL as one line {"batch": id, "rows": [...]}, written and fsynced before
Spark commits the batch (foreachBatch: a batch replayed after a crash is written again under the same id).
The memory sink cannot be used here: Spark refuses to recover it from a checkpoint in append mode.

first:  catch up with Trigger.AvailableNow (batches 0..k), then start again on the same checkpoint with the
        fault point of STREAM_FAULT_PAUSE armed in the executors: the next batch's read() pauses there until
        the test kills this process group.
resume: restart from the checkpoint (the planned, uncommitted batch is replayed) and follow the source until
        killed.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    source, slot, checkpoint, out, max_bytes, mode = sys.argv[1:7]

    from sluicegate.spark import stream_source
    from sluicegate.spark.session import get_spark

    spark = get_spark("local[2]", app_name="stream-source-test")
    stream_source.register(spark)

    def write_batch(df, batch_id: int) -> None:
        rows = [r.asDict() for r in df.select("lsn", "commit_lsn", "schema", "table", "op", "before", "after")
                .collect()]
        with open(out, "a") as f:
            f.write(json.dumps({"batch": batch_id, "rows": rows}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def start(trigger: dict):
        df = (spark.readStream.format("sluicegate").option("source", source).option("slot", slot)
              .option("maxBytesPerBatch", max_bytes).load())
        return (df.writeStream.foreachBatch(write_batch).option("checkpointLocation", checkpoint)
                .trigger(**trigger).start())

    if mode == "first":
        query = start({"availableNow": True})
        query.awaitTermination()
        # Executors get the environment the data source was registered with: arm the pause point for the
        # second query only (the first must run through).
        env = spark.sparkContext.environment
        env["SLUICEGATE_FAULT_PAUSE"] = os.environ["STREAM_FAULT_PAUSE"]
        env["SLUICEGATE_FAULT_DIR"] = os.environ["STREAM_FAULT_DIR"]
        stream_source.register(spark)
    query = start({"processingTime": "200 milliseconds"})
    while query.isActive:  # until killed (or failed: then say why)
        time.sleep(0.5)
    print(f"query ended: {query.exception()}", file=sys.stderr)
    sys.exit(3)


if __name__ == "__main__":
    main()
