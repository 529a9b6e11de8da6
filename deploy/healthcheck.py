#!/usr/bin/env python3
"""Container HEALTHCHECK: exit 0 when the URL answers 200, else 1.

`genq-healthcheck URL` probes URL; without one, this container's worker HTTP server
(`http://127.0.0.1:$GENQ_METRICS_PORT/healthz`). Standard library only: it runs in every image.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def target(argv: list[str]) -> str:
    if len(argv) > 1:
        return argv[1]
    port = os.environ.get("GENQ_METRICS_PORT")
    if not port:
        raise SystemExit("genq-healthcheck: no URL given and GENQ_METRICS_PORT is unset")
    return f"http://127.0.0.1:{port}/healthz"


def main(argv: list[str]) -> int:
    url = target(argv)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            ok = reply.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"genq-healthcheck: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
