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

from genq.client import add_api_key_flag, add_url_flag, auth_headers, fail, one_line_errors

DEFAULT_ENDPOINT = "/v1/chat/completions"
POLL_S = 1.0
ENDED = ("completed", "failed", "expired", "cancelled")
INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT)."""
DOWNLOAD_CHUNK = 1 << 16


def add_parser(sub: Any) -> None:
    """`genq batch` and its commands, under the `genq` parser's subparsers."""
    about = "batches of requests from a JSONL file (OpenAI Batch API)"
    p = sub.add_parser("batch", help=about, description=f"{about}.")
    commands = p.add_subparsers(dest="batch_command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        c: argparse.ArgumentParser = commands.add_parser(
            name, help=help_, description=f"{help_[0].upper()}{help_[1:]}."
        )
        add_url_flag(c)
        add_api_key_flag(c)
        return c

    c = command("submit", "upload FILE.jsonl and start a batch of its lines")
    c.add_argument("file", type=Path, help="the requests, one JSON object a line")
    c.add_argument(
        "--endpoint", help="the route of every line (default: the url of the file's first line)"
    )
    c.add_argument("--window", default="24h", help="completion window: 24h, or shorter (90m)")
    c.add_argument("--wait", action="store_true", help="show progress, then fetch the results")
    c.add_argument("-o", "--output", type=Path, help="with --wait: write the results here")
    c = command("status", "one batch: status and counts")
    c.add_argument("id", help="the batch's id (batch_…)")
    c.add_argument("--json", action="store_true", help="the Batch object as JSON")
    c = command("list", "recent batches")
    c.add_argument("--limit", type=int, default=20, help="most batches shown, newest first")
    c = command("cancel", "cancel a batch (what finished is kept)")
    c.add_argument("id", help="the batch's id (batch_…)")
    c = command("results", "fetch a batch's output file (or its error file)")
    c.add_argument("id", help="the batch's id (batch_…)")
    c.add_argument("-o", "--output", type=Path, help="the file to write (default: stdout)")
    c.add_argument("--errors", action="store_true", help="the error file instead")


def main(args: argparse.Namespace) -> int:
    """The command; every failure (the gateway's error answer, no gateway, a file that cannot
    be read or written) is one line on stderr and exit status 1."""

    def run() -> int:
        with httpx.Client(base_url=args.url, headers=auth_headers(args), timeout=None) as client:
            try:
                return _COMMANDS[args.batch_command](client, args)
            except ApiError as exc:
                return fail(str(exc))

    return one_line_errors(args.url, run)


class ApiError(Exception):
    """An error answer of the gateway, as its message."""


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    r = client.request(method, path, **kwargs)
    if r.status_code >= 400:
        raise _api_error(r)
    return r.json()


def _api_error(r: httpx.Response) -> ApiError:
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text
    return ApiError(f"{r.status_code}: {message}")


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
    try:
        batch = _call(client, "POST", "/v1/batches", json=body)
    except (ApiError, httpx.TransportError):
        _forget(client, uploaded["id"])
        raise
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


def _forget(client: httpx.Client, file_id: str) -> None:
    """Delete the file uploaded for a batch that was not created: nothing else would use it.
    Best effort: the batch's own failure is what the user is told."""
    try:
        client.delete(f"/v1/files/{file_id}")
    except httpx.TransportError:
        pass


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
            raise _api_error(r)
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
