"""`genq gateway`: N uvicorn processes serving the gateway app, each building its own settings."""

from __future__ import annotations

import logging
import signal

import uvicorn

from gateway.app import create_app
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)
LISTEN_BACKLOG = 4096


def run_gateway(settings: GatewaySettings, host: str, port: int, processes: int) -> None:
    """N uvicorn worker processes; each builds its own settings from GENQ_* (set by the CLI)."""
    # uvicorn drains on SIGTERM (stops accepting, lets open streams finish within the grace),
    # then re-raises the signal into the handler it found installed. With the default one the
    # drained gateway would die by SIGTERM; with this one it exits 0.
    # Built once here, for its checks only: a setting the app refuses stops the start now,
    # where the children uvicorn forks would each fail and be respawned forever.
    create_app(settings)
    signal.signal(signal.SIGTERM, _drained)
    uvicorn.run(
        "gateway.app:create_app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=processes,
        log_level="warning",
        access_log=False,  # one line per request and per stream costs more than it tells
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        backlog=LISTEN_BACKLOG,
    )


def _drained(signum: int, frame: object) -> None:
    log.info("gateway drained", extra={"signal": signum})
