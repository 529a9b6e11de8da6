"""uvicorn's HTTP protocol, plus a way for the app to drop a connection at once.

Returning from an ASGI app mid-response makes uvicorn `close()` the transport, and a closing
transport still waits to hand its buffered bytes to a client that may never read them: the
connection, its buffers and the kernel's stay. A stream whose client stopped reading must
really let go, so the scope carries `genq.abort` (`{"abort": callable}`): the transport's
`abort()`, which drops the buffers and resets the connection.

An SSE stream's keepalive comments are written by one loop for all streams
(`gateway.keepalive`), straight to the connection: the scope carries `genq.keepalive`
(`{"write": callable}`), which writes one chunk of the response in progress, framed as uvicorn
frames its chunks, unless that response is not a chunked one still open on this connection
or the client is not reading (uvicorn has paused writing).

A response that never ends by itself (the dashboard's stream) must end when the server
shuts down, or the shutdown waits out its whole grace for it: the scope carries
`genq.shutdown` (`{"event": asyncio.Event}`), set when uvicorn begins its graceful shutdown.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

ABORT_EXTENSION = "genq.abort"
KEEPALIVE_EXTENSION = "genq.keepalive"
SHUTDOWN_EXTENSION = "genq.shutdown"
HTTP_PROTOCOL = "gateway.http_protocol:AbortableHttpToolsProtocol"
"""uvicorn's `http` setting for genq's servers (an import string: spawned processes load it)."""


class AbortableHttpToolsProtocol(HttpToolsProtocol):
    _shutting_down: asyncio.Event | None = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._shutting_down is None:
            self._shutting_down = asyncio.Event()
        scope = self.scope

        def write(chunk: bytes) -> bool:
            return self._write_chunk(scope, chunk)

        self.scope["extensions"] = {
            ABORT_EXTENSION: {"abort": self._abort},
            SHUTDOWN_EXTENSION: {"event": self._shutting_down},
            KEEPALIVE_EXTENSION: {"write": write},
        }

    def shutdown(self) -> None:
        if self._shutting_down is not None:
            self._shutting_down.set()
        super().shutdown()

    def _write_chunk(self, scope: object, chunk: bytes) -> bool:
        """One chunk of the response to the request of `scope`, if that response is the one
        in progress here, chunked, and the client takes what it is sent."""
        cycle = self.cycle
        transport = self.transport
        if (
            cycle is None
            or cycle.scope is not scope
            or not cycle.response_started
            or cycle.response_complete
            or cycle.disconnected
            or not cycle.chunked_encoding
            or transport is None
            or transport.is_closing()
            or self.flow.write_paused
        ):
            return False
        transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        return True

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
