"""uvicorn's HTTP protocol, plus a way for the app to drop a connection at once.

Returning from an ASGI app mid-response makes uvicorn `close()` the transport, and a closing
transport still waits to hand its buffered bytes to a client that may never read them: the
connection, its buffers and the kernel's stay. A stream whose client stopped reading must
really let go, so the scope carries `genq.abort` (`{"abort": callable}`): the transport's
`abort()`, which drops the buffers and resets the connection.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

ABORT_EXTENSION = "genq.abort"
HTTP_PROTOCOL = "gateway.http_protocol:AbortableHttpToolsProtocol"
"""uvicorn's `http` setting for genq's servers (an import string: spawned processes load it)."""


class AbortableHttpToolsProtocol(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {ABORT_EXTENSION: {"abort": self._abort}}

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
