"""`genq gateway`: N uvicorn processes serving the gateway app, each building its own settings.

The listening socket is made first (`listen`), before any worker or uvicorn process starts, so
a busy port stops the command at once with one line instead of leaving half a service running.
"""

from __future__ import annotations

import inspect
import logging
import signal
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.supervisors import Multiprocess

from gateway import multiproc
from gateway.app import create_app
from gateway.http_protocol import HTTP_PROTOCOL
from gateway.stopping import Stopping, uvicorn_timeout_s
from shared import logs
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)
LISTEN_BACKLOG = 4096


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening; SystemExit with one line when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections of a socket that says so
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # as uvicorn does: a restart may rebind at once while the old connections sit in TIME_WAIT
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise SystemExit(
            f"genq: error: cannot listen on {host}:{port}: {reason} (another --port, or stop "
            "what holds it)"
        ) from None
    # Not inheritable (Python's default, said here since it matters): uvicorn hands it to its
    # worker processes by name, and no other child (an engine process, a redis-server) may
    # hold the port open after the gateway has gone.
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket) -> str:
    """http://host:port of a listening socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_gateway(
    settings: GatewaySettings,
    sock: socket.socket,
    processes: int,
    attach: Callable[[Stopping], None] | None = None,
) -> None:
    """N uvicorn worker processes on `sock`; each builds its own settings from GENQ_* (set by
    the CLI). One process serves an app built here, whose stop (gateway/stopping.py) `attach`
    may act on too."""
    # uvicorn drains on SIGTERM and SIGINT (gateway/stopping.py), then re-raises the signal
    # into the handler it found installed. With the default ones the drained gateway would die
    # by SIGTERM, or raise KeyboardInterrupt with a traceback; with this one it exits 0. Before
    # uvicorn serves, a signal stops the start.
    handler = _Drained()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    # Built once here, for its checks only: a setting the app refuses stops the start now,
    # where the children uvicorn forks would each fail and be respawned forever.
    create_app(settings)
    options: dict[str, Any] = {
        "log_config": logs.log_config(settings),  # uvicorn applies it in each process it spawns
        "access_log": False,  # genq's own (gateway/access_log.py, GENQ_ACCESS_LOG) replaces it
        "http": HTTP_PROTOCOL,  # streams can drop a client that stopped reading
        # past the grace and the streams' ends: uvicorn's own timeout cuts streams without one
        "timeout_graceful_shutdown": uvicorn_timeout_s(settings.shutdown_grace_s),
        "backlog": LISTEN_BACKLOG,
    }
    # N processes share their metrics through files (gateway/multiproc.py); one keeps its own
    # unless PROMETHEUS_MULTIPROC_DIR is set, whose files are then emptied too
    made = multiproc.prepare() if processes > 1 or multiproc.directory() else None
    try:
        if processes > 1:
            app = "gateway.app:create_app_from_env"
            handler.serving = True  # the supervisor takes the signals over
            _supervise(uvicorn.Config(app, factory=True, workers=processes, **options), sock)
        else:
            one = create_app(settings, signals=True)  # after `prepare`: its metrics use the files
            if attach is not None:
                attach(one.state.stopping)
            handler.serving = True
            uvicorn.Server(uvicorn.Config(one, **options)).run(sockets=[sock])
    finally:
        sock.close()
        multiproc.remove(made)


def _supervise(config: uvicorn.Config, sock: socket.socket) -> None:
    """uvicorn's supervisor of N processes on one socket, as `uvicorn.run(workers=N)` runs it
    (it takes the socket it binds itself; genq binds first). uvicorn 0.51 dropped `target`."""
    if "target" in inspect.signature(Multiprocess).parameters:
        target = uvicorn.Server(config).run
        Multiprocess(config, target=target, sockets=[sock]).run()  # type: ignore[call-arg]
    else:
        Multiprocess(config, sockets=[sock]).run()


class _Drained:
    """SIGTERM and SIGINT around uvicorn's own handlers: before it serves, the start stops
    (exit 128 + the signal); after, the signal it re-raises is the drain's end."""

    serving = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.serving:
            raise SystemExit(128 + signum)
        log.info("gateway drained", extra={"signal": signum})
