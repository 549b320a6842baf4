"""The plugins every stream has: the default replicator (passes messages on as they are) and the JSON applier
(one message per line on standard output, the shape of `model.to_json`)."""

from __future__ import annotations

import json
import sys

from .model import Transaction, to_json


class DefaultReplicator:
    def replicate(self, txn: Transaction) -> Transaction | None:
        return txn


class JsonApplier:
    def __init__(self, out=None):
        self.out = out or sys.stdout

    def apply(self, txn: Transaction) -> None:
        self.out.write(json.dumps(to_json(txn), separators=(",", ":")) + "\n")
        self.out.flush()  # a reader of the pipe sees each message as it comes

    def close(self) -> None:
        self.out.flush()
