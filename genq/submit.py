"""`genq submit`: one prompt, its text printed (streamed as it arrives with --stream)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx

from genq.client import auth_headers


def submit(args: argparse.Namespace) -> int:
    try:
        return _submit(args)
    except httpx.ConnectError:
        print(
            f"genq: error: nothing answers at {args.url} (is genq serve running?)", file=sys.stderr
        )
    except httpx.TransportError as exc:
        print(f"genq: error: the connection to {args.url} failed: {exc}", file=sys.stderr)
    return 1


def _submit(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {
        "model": args.model,
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "priority": args.priority,
    }
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.seed is not None:
        body["seed"] = args.seed
    with httpx.Client(base_url=args.url, headers=auth_headers(args), timeout=None) as client:
        if not args.stream:
            r = client.post("/v1/jobs", json=body)
            if r.status_code >= 400:
                return _fail(r)
            job_id = r.json()["id"]
        else:
            body["stream"] = True
            body["cancel_on_disconnect"] = True
            with client.stream("POST", "/v1/jobs", json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    return _fail(r)
                job_id = r.headers["x-job-id"]
                for etype, data in _events(r.iter_lines()):
                    if etype == "token":
                        sys.stdout.write(data["text"])
                        sys.stdout.flush()
                    elif etype == "error":
                        print(f"\nerror: {data['message']}", file=sys.stderr)
                        return 1
                print()
            return 0
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            for etype, data in _events(r.iter_lines()):
                if etype == "error":
                    print(f"error: {data['message']}", file=sys.stderr)
                    return 1
        print(client.get(f"/v1/jobs/{job_id}").json()["text"])
    return 0


def _events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    etype = None
    for line in lines:
        if line.startswith("event: "):
            etype = line[7:]
        elif line.startswith("data: ") and etype:
            yield etype, json.loads(line[6:])


def _fail(r: httpx.Response) -> int:
    try:
        msg = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = r.text
    print(f"error {r.status_code}: {msg}", file=sys.stderr)
    return 1
