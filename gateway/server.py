"""`genq gateway`: N uvicorn processes serving the gateway app, each building its own settings."""

from __future__ import annotations

import logging
import signal

import uvicorn

from shared import logs
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)
LISTEN_BACKLOG = 4096


def run_gateway(settings: GatewaySettings, host: str, port: int, processes: int) -> None:
    """N uvicorn worker processes; each builds its own settings from GENQ_* (set by the CLI)."""
    # uvicorn drains on SIGTERM (stops accepting, lets open streams finish within the grace),
    # then re-raises the signal into the handler it found installed. With the default one the
    # drained gateway would die by SIGTERM; with this one it exits 0.
    signal.signal(signal.SIGTERM, _drained)
    uvicorn.run(
        "gateway.app:create_app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=processes,
        log_config=logs.log_config(settings),  # uvicorn applies it in each process it spawns
        access_log=False,  # one line per request and per stream costs more than it tells
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        backlog=LISTEN_BACKLOG,
    )


def _drained(signum: int, frame: object) -> None:
    log.info("gateway drained", extra={"signal": signum})
