"""`genq batch`: the Batches API from the command line.

    genq batch submit FILE.jsonl [--endpoint E] [--window 24h] [--wait] [-o results.jsonl]
    genq batch status ID | list | cancel ID | results ID [-o FILE] [--errors]

`submit --wait` shows a live progress bar (completed/failed of total, rate, ETA) and, once the
batch ends, writes its output file (to -o, else stdout) and its error file (beside -o, as
NAME.errors.jsonl). Ctrl-C while waiting leaves the batch running and says how to follow it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import httpx
from tqdm import tqdm

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_ENDPOINT = "/v1/chat/completions"
POLL_S = 1.0
ENDED = ("completed", "failed", "expired", "cancelled")
INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT)."""
DOWNLOAD_CHUNK = 1 << 16


def add_parser(sub: Any) -> None:
    """`genq batch` and its commands, under the `genq` parser's subparsers."""
    p = sub.add_parser("batch", help="batches of requests from a JSONL file (OpenAI Batch API)")
    commands = p.add_subparsers(dest="batch_command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        c = commands.add_parser(name, help=help_)
        c.add_argument("--url", default=DEFAULT_URL, help=f"the gateway (default {DEFAULT_URL})")
        c.add_argument("--api-key")
        return c

    c = command("submit", "upload FILE.jsonl and start a batch of its lines")
    c.add_argument("file", type=Path)
    c.add_argument("--endpoint", help="default: the url of the file's first line")
    c.add_argument("--window", default="24h", help="completion window: 24h, or shorter (90m)")
    c.add_argument("--wait", action="store_true", help="show progress, then fetch the results")
    c.add_argument("-o", "--output", type=Path, help="with --wait: write the results here")
    c = command("status", "one batch: status and counts")
    c.add_argument("id")
    c.add_argument("--json", action="store_true", help="the Batch object as JSON")
    c = command("list", "recent batches")
    c.add_argument("--limit", type=int, default=20)
    c = command("cancel", "cancel a batch (what finished is kept)")
    c.add_argument("id")
    c = command("results", "fetch a batch's output file (or its error file)")
    c.add_argument("id")
    c.add_argument("-o", "--output", type=Path, help="default: stdout")
    c.add_argument("--errors", action="store_true", help="the error file instead")


def main(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=None) as client:
        try:
            return _COMMANDS[args.batch_command](client, args)
        except ApiError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1


class ApiError(Exception):
    """An error answer of the gateway, as its message."""


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    r = client.request(method, path, **kwargs)
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        raise ApiError(f"{r.status_code}: {message}")
    return r.json()


# ---- commands -----------------------------------------------------------------------------


def _submit(client: httpx.Client, args: argparse.Namespace) -> int:
    path: Path = args.file
    endpoint = args.endpoint or _first_url(path) or DEFAULT_ENDPOINT
    with path.open("rb") as f:
        uploaded = _call(
            client, "POST", "/v1/files", data={"purpose": "batch"}, files={"file": (path.name, f)}
        )
    body = {
        "input_file_id": uploaded["id"],
        "endpoint": endpoint,
        "completion_window": args.window,
    }
    batch = _call(client, "POST", "/v1/batches", json=body)
    try:  # from here on, Ctrl-C leaves a batch that exists: say how to follow it
        print(f"batch {batch['id']}: {batch['request_counts']['total']} requests", file=sys.stderr)
        if not args.wait:
            print(batch["id"])
            return 0
        batch = _wait(client, batch)
    except KeyboardInterrupt:
        print(
            f"\nbatch {batch['id']} keeps running. Follow it with `genq batch status "
            f"{batch['id']}`; when it ends, `genq batch results {batch['id']} -o FILE`.",
            file=sys.stderr,
        )
        return INTERRUPTED
    return _fetch_all(client, batch, args.output)


def _status(client: httpx.Client, args: argparse.Namespace) -> int:
    batch = _call(client, "GET", f"/v1/batches/{args.id}")
    if args.json:
        print(json.dumps(batch, indent=2))
    else:
        print(_summary(batch))
        for e in (batch.get("errors") or {}).get("data") or []:
            print(f"  error {e['code']}: {e['message']}")
    return 0


def _list(client: httpx.Client, args: argparse.Namespace) -> int:
    page = _call(client, "GET", "/v1/batches", params={"limit": args.limit})
    for batch in page["data"]:
        print(_summary(batch))
    return 0


def _cancel(client: httpx.Client, args: argparse.Namespace) -> int:
    print(_summary(_call(client, "POST", f"/v1/batches/{args.id}/cancel")))
    return 0


def _results(client: httpx.Client, args: argparse.Namespace) -> int:
    batch = _call(client, "GET", f"/v1/batches/{args.id}")
    file_id = batch["error_file_id" if args.errors else "output_file_id"]
    if file_id is None:
        what = "error" if args.errors else "output"
        print(f"batch {args.id} ({batch['status']}) has no {what} file", file=sys.stderr)
        return 1
    if args.output is None:
        _download(client, file_id, sys.stdout.buffer)
    else:
        with args.output.open("wb") as out:
            _download(client, file_id, out)
    return 0


_COMMANDS = {
    "submit": _submit,
    "status": _status,
    "list": _list,
    "cancel": _cancel,
    "results": _results,
}


# ---- helpers ------------------------------------------------------------------------------


def _first_url(path: Path) -> str | None:
    with path.open("rb") as f:
        first = f.readline()
    try:
        url = json.loads(first).get("url")
    except (ValueError, AttributeError):
        return None
    return url if isinstance(url, str) else None


def _wait(client: httpx.Client, batch: dict[str, Any]) -> dict[str, Any]:
    """Poll until the batch ends, with a progress bar on stderr."""
    counts = batch["request_counts"]
    with tqdm(total=counts["total"], unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
        while True:
            counts = batch["request_counts"]
            bar.set_postfix(
                status=batch["status"],
                completed=counts["completed"],
                failed=counts["failed"],
                refresh=False,
            )
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            if batch["status"] in ENDED:
                return batch
            time.sleep(POLL_S)
            batch = _call(client, "GET", f"/v1/batches/{batch['id']}")


def _fetch_all(client: httpx.Client, batch: dict[str, Any], output: Path | None) -> int:
    print(_summary(batch), file=sys.stderr)
    if batch["output_file_id"]:
        if output is None:
            _download(client, batch["output_file_id"], sys.stdout.buffer)
        else:
            with output.open("wb") as out:
                _download(client, batch["output_file_id"], out)
            print(f"results: {output}", file=sys.stderr)
    if batch["error_file_id"]:
        if output is None:
            print(
                f"{batch['request_counts']['failed']} requests failed: "
                f"`genq batch results {batch['id']} --errors`",
                file=sys.stderr,
            )
        else:
            errors = output.with_name(f"{output.stem}.errors{output.suffix or '.jsonl'}")
            with errors.open("wb") as out:
                _download(client, batch["error_file_id"], out)
            print(f"errors: {errors}", file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1


def _download(client: httpx.Client, file_id: str, out: IO[bytes]) -> None:
    with client.stream("GET", f"/v1/files/{file_id}/content") as r:
        if r.status_code >= 400:
            r.read()
            raise ApiError(f"{r.status_code}: {r.text}")
        for chunk in r.iter_bytes(DOWNLOAD_CHUNK):
            out.write(chunk)
    out.flush()


def _summary(batch: dict[str, Any]) -> str:
    c = batch["request_counts"]
    created = datetime.fromtimestamp(batch["created_at"]).strftime("%Y-%m-%d %H:%M:%S")
    return (
        f"{batch['id']}  {batch['status']:<11}  {c['completed'] + c['failed']}/{c['total']} "
        f"done ({c['failed']} failed)  {batch['endpoint']}  created {created}"
    )
