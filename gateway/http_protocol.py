"""uvicorn's HTTP protocol, plus a way for the app to drop a connection at once.

Returning from an ASGI app mid-response makes uvicorn `close()` the transport, and a closing
transport still waits to hand its buffered bytes to a client that may never read them: the
connection, its buffers and the kernel's stay. A stream whose client stopped reading must
really let go, so the scope carries `genq.abort` (`{"abort": callable}`): the transport's
`abort()`, which drops the buffers and resets the connection.

A response that never ends by itself (the dashboard's stream) must end when the server
shuts down, or the shutdown waits out its whole grace for it: the scope carries
`genq.shutdown` (`{"event": asyncio.Event}`), set when uvicorn begins its graceful shutdown.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

ABORT_EXTENSION = "genq.abort"
SHUTDOWN_EXTENSION = "genq.shutdown"
HTTP_PROTOCOL = "gateway.http_protocol:AbortableHttpToolsProtocol"
"""uvicorn's `http` setting for genq's servers (an import string: spawned processes load it)."""


class AbortableHttpToolsProtocol(HttpToolsProtocol):
    _shutting_down: asyncio.Event | None = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._shutting_down is None:
            self._shutting_down = asyncio.Event()
        self.scope["extensions"] = {
            ABORT_EXTENSION: {"abort": self._abort},
            SHUTDOWN_EXTENSION: {"event": self._shutting_down},
        }

    def shutdown(self) -> None:
        if self._shutting_down is not None:
            self._shutting_down.set()
        super().shutdown()

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
