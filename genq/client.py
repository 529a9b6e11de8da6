"""What the client commands (`submit`, `bench`, `batch`) share: the gateway's address and the
API key flags, read from GENQ_URL and GENQ_API_KEY too, and their failures as one line on
stderr instead of a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import httpx

API_KEY_ENV = "GENQ_API_KEY"
"""The variable a client command reads its API key from when `--api-key` is not given: a key
on the command line lands in the shell's history and in `ps`."""
DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "GENQ_URL"
"""The variable a client command reads the gateway's address from when `--url` is not given:
set once for a gateway on another host or port (`genq serve --port`)."""


def add_url_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get(URL_ENV) or DEFAULT_URL,
        help=f"the gateway (default: ${URL_ENV}, else {DEFAULT_URL})",
    )


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        help=f"the key to send, when the gateway asks for one (default: ${API_KEY_ENV}, which "
        "keeps it out of shell history and ps)",
    )


def api_key(args: argparse.Namespace) -> str | None:
    """`--api-key`, else GENQ_API_KEY, else None (an open gateway)."""
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    key = api_key(args)
    return {"Authorization": f"Bearer {key}"} if key else {}


def fail(message: str) -> int:
    print(f"genq: error: {message}", file=sys.stderr)
    return 1


def one_line_errors(url: str, run: Callable[[], int]) -> int:
    """`run()`, with a gateway that does not answer, a connection that breaks, or a file that
    cannot be read or written told in one line (exit status 1). A closed stdout (`| head`) is
    left to `genq.cli.main`."""
    try:
        return run()
    except httpx.ConnectError:
        return fail(f"nothing answers at {url} (is genq serve running?)")
    except httpx.TransportError as exc:
        return fail(f"the connection to {url} failed: {exc or type(exc).__name__}")
    except BrokenPipeError:
        raise
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return fail(f"{where}{exc.strerror or exc}")
