"""VStream: a source's changes as Transaction messages over gRPC (the change model's stream API).

`source` reads one client's changes from the source (its own slot and publication), `server` serves them,
`client` reads them back (from a server, or from the source directly) and reconnects after a lost connection.
"""

from .client import Stream, stream
from .security import ClientSecurity, ServerSecurity
from .server import VStreamServer, VStreamService
from .source import Heartbeat, capture_name, transactions

__all__ = ["ClientSecurity", "Heartbeat", "ServerSecurity", "Stream", "VStreamServer", "VStreamService", "capture_name", "stream", "transactions"]
