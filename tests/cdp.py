"""Headless Debian Chromium driven over the Chrome DevTools Protocol (a websocket, the
`websockets` package): no driver binary, no browser download. Every host but 127.0.0.1 is
unresolvable, as on a host without internet. Console messages, uncaught exceptions and
failed loads are collected, so a test can assert that a page ran without errors."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from tests.procs import free_port, wait_for

OFFLINE = "MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
"""Chromium's host rules: every name fails to resolve, as on a host without internet."""
COMMAND_TIMEOUT_S = 30.0


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def headless_args(path: str, profile: Path) -> list[str]:
    """Chromium, headless, with a profile of its own and no network but 127.0.0.1."""
    return [
        path,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        f"--user-data-dir={profile}",
        f"--host-resolver-rules={OFFLINE}",
    ]


class Page:
    """One browser tab: `call` a CDP method, `evaluate` JavaScript, read `errors`."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._next = 0
        self.errors: list[str] = []
        """Console errors, uncaught exceptions and failed loads, as text."""

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        ident = self._next
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.0, deadline - time.monotonic())))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self._event(message)

    def _event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or str(details))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a)) for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"{entry.get('text')} {entry.get('url', '')}".strip())

    def pump(self) -> None:
        """Read the events that arrived meanwhile (errors among them)."""
        with contextlib.suppress(TimeoutError):
            while True:
                self._event(json.loads(self._ws.recv(timeout=0)))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 20.0) -> Any:
        """The value of `expression` once it is truthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"page never had {expression}")

    def open(self, url: str) -> None:
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable")
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'")


@contextlib.contextmanager
def browser(profile: Path, width: int = 1280, height: int = 800) -> Iterator[Page]:
    """A headless Chromium with one tab; closed on exit."""
    path = chromium_path()
    assert path is not None
    port = free_port()
    proc = subprocess.Popen(
        [
            *headless_args(path, profile),
            f"--remote-debugging-port={port}",
            f"--window-size={width},{height}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        targets: list[dict[str, Any]] = []

        def page_target() -> bool:
            targets[:] = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=1).json()
            return any(t["type"] == "page" for t in targets)

        wait_for(page_target, timeout=30, what="chromium's DevTools")
        url = next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"]
        with connect(url, max_size=None, open_timeout=COMMAND_TIMEOUT_S) as ws:
            yield Page(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
