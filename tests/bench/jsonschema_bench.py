"""Real-world JSON schemas (JSONSchemaBench) through the openai SDK, as an app would send them:
each schema as a chat completion's `response_format` (`json_schema`), once with `strict:
false` and once with `strict: true`, against a running genq (the sim engine is enough: it
emits only what the grammar allows and closes what is open when its budget runs low).

    python -m tests.bench.jsonschema_bench                  # its own redis, gateway, sim worker
    python -m tests.bench.jsonschema_bench --url http://127.0.0.1:8000 --model NAME
    python -m tests.bench.jsonschema_bench --tarball PATH --concurrency 8 --max-tokens 8000
    python -m tests.bench.jsonschema_bench --costs          # no genq: what the pieces cost

The tarball (default ../shared/structured/jsb-dev-400.tar.xz beside the checkout) holds
`DATASET__NAME.json` files, each `{"schema": …}`. Every output is validated client-side with
`jsonschema` under the schema's own draft (formats checked where the library knows them),
independently of genq's own check. Prints a table per mode and dataset, then JSON:

  n           schemas
  answered    share answered 200 with output (the coverage the target is set on)
  valid       share whose output validates (the paper's coverage: a refusal or an invalid
              output counts against it)
  compliance  valid / answered (the paper's compliance)
  invalid     answers that ended (`stop`) and do not validate: with strict true, a defect
  length      answers cut by max_tokens (invalid JSON: the sim's walk did not end in time)
  4xx, 5xx    refusals by status class (4xx: a keyword strict cannot enforce, a schema
              llguidance cannot compile even leniently)
  agree       answers where genq's `genq-schema-valid` says what the client's check says
              (the rest: schemas the client's validator cannot use count as disagreeing)

--costs measures, in this process, per schema of the tarball: the gateway's plan of a strict
and of a lenient schema (shared/schema_gaps.py: llguidance compiles without a tokenizer), and
the worker's check of the dataset's own first valid example (worker/output_check.py): the
first (the validator built) and the next (kept); p50, p90, p99 and max in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tarfile
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai

from shared.constraints import Constraint
from shared.schema_gaps import plan_schema
from tests.procs import Cluster, redis_server
from worker.output_check import Validators

DEFAULT_TARBALL = Path(__file__).resolve().parents[3] / "shared/structured/jsb-dev-400.tar.xz"
"""`../shared/structured/…` beside the checkout (the project's shared folder)."""
DEPLOY_REDIS_CONF = Path(__file__).resolve().parents[2] / "deploy" / "redis.conf"
PREFIX = "benchjsb:"
ASK = "Give an example of a JSON document for this schema."
HTTP_TIMEOUT_S = 600.0
MODES = ("strict false", "strict true")
STARTUP_S = 120.0
"""How long the gateway and worker may take to start (a busy shared box is slow)."""


@dataclass
class Outcome:
    status: int
    answered: bool = False
    valid: bool | None = None
    """The client's verdict; None where its validator cannot use the schema."""
    length: bool = False
    genq_valid: str | None = None
    refusal: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        o = self.outcomes
        n = len(o)
        answered = [x for x in o if x.answered]
        valid = [x for x in answered if x.valid]
        agree = [x for x in answered if x.genq_valid == json.dumps(x.valid)]
        return {
            "n": n,
            "answered": round(len(answered) / n, 3) if n else 0.0,
            "valid": round(len(valid) / n, 3) if n else 0.0,
            "compliance": round(len(valid) / len(answered), 3) if answered else 0.0,
            "invalid": sum(not x.length and x.valid is False for x in answered),
            "length": sum(x.length for x in answered),
            "4xx": sum(400 <= x.status < 500 for x in o),
            "5xx": sum(x.status >= 500 for x in o),
            "agree": len(agree),
        }


def load(tarball: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(dataset, name, schema) of every schema in the tarball, in name order."""
    out = []
    with tarfile.open(tarball) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not member.isfile() or not member.name.endswith(".json"):
                continue
            f = tar.extractfile(member)
            assert f is not None
            name = Path(member.name).stem
            dataset = name.split("__", 1)[0]
            out.append((dataset, name, json.loads(f.read())["schema"]))
    return out


def client_verdict(schema: dict[str, Any], instance: Any) -> bool | None:
    """Whether `instance` is valid under `schema` (its own draft, formats checked); None where
    the validator cannot use the schema."""
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        return bool(validator.is_valid(instance))
    except Exception:  # a schema jsonschema cannot use: no verdict
        return None


async def one(
    client: openai.AsyncOpenAI, model: str, schema: dict[str, Any], strict: bool, max_tokens: int
) -> Outcome:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}}
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": ASK}],
            response_format=fmt,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            seed=0,
        )
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        keyword = str(body.get("param") or "").rsplit(".", 1)[-1]
        return Outcome(exc.status_code, refusal=f"{exc.status_code} {body.get('code')} {keyword}")
    r = raw.parse()
    choice = r.choices[0]
    text = choice.message.content or ""
    out = Outcome(raw.status_code, answered=bool(text), length=choice.finish_reason == "length")
    out.genq_valid = raw.headers.get("genq-schema-valid")
    try:
        instance = json.loads(text)
    except ValueError:
        out.valid = False
        return out
    out.valid = await asyncio.to_thread(client_verdict, schema, instance)
    return out


async def run(
    args: argparse.Namespace, url: str, schemas: list[tuple[str, str, dict[str, Any]]]
) -> dict[str, Any]:
    gate = asyncio.Semaphore(args.concurrency)
    tallies: dict[str, dict[str, Tally]] = {m: defaultdict(Tally) for m in MODES}
    refusals: dict[str, Counter[str]] = {m: Counter() for m in MODES}
    failures: dict[str, list[str]] = {m: [] for m in MODES}
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=args.api_key, max_retries=0, timeout=HTTP_TIMEOUT_S
    ) as client:

        async def task(mode: str, dataset: str, name: str, schema: dict[str, Any]) -> None:
            async with gate:
                o = await one(client, args.model, schema, mode == "strict true", args.max_tokens)
            tallies[mode][dataset].outcomes.append(o)
            tallies[mode]["all"].outcomes.append(o)
            if o.refusal:
                refusals[mode][o.refusal] += 1
            if o.answered and o.valid is False:
                failures[mode].append(f"{name}{' (length)' if o.length else ''}")

        started = time.monotonic()
        await asyncio.gather(*(task(m, d, n, s) for m in MODES for d, n, s in schemas))
        elapsed = time.monotonic() - started
    return {
        "schemas": len(schemas),
        "max_tokens": args.max_tokens,
        "seconds": round(elapsed, 1),
        "modes": {m: {d: t.row() for d, t in sorted(tallies[m].items())} for m in MODES},
        "refusals": {m: dict(refusals[m].most_common(12)) for m in MODES},
        "invalid_outputs": {m: sorted(failures[m]) for m in MODES},
    }


def print_table(result: dict[str, Any]) -> None:
    cols = ("n", "answered", "valid", "compliance", "invalid", "length", "4xx", "5xx", "agree")
    for mode, rows in result["modes"].items():
        print(f"\n{mode}")
        print(f"{'dataset':<18}" + "".join(f"{c:>11}" for c in cols))
        for dataset, row in sorted(rows.items(), key=lambda kv: (kv[0] == "all", kv[0])):
            print(f"{dataset:<18}" + "".join(f"{row[c]:>11}" for c in cols))


@contextmanager
def own_stack(args: argparse.Namespace) -> Iterator[str]:
    """A redis-server, a gateway and a sim worker of this benchmark's own."""
    with (
        tempfile.TemporaryDirectory(prefix="genq-jsb-") as tmp,
        redis_server(DEPLOY_REDIS_CONF) as server,
    ):
        cluster = Cluster(server.url, Path(tmp), PREFIX)
        try:
            gw = cluster.gateway(ready_s=STARTUP_S)
            batch = str(args.concurrency * 2)
            cluster.worker("--step-ms", "0", "--max-batch", batch, ready_s=STARTUP_S)
            yield gw.url
        finally:
            cluster.close()


def costs(schemas: list[tuple[str, str, dict[str, Any]]], tarball: Path) -> dict[str, Any]:
    examples: dict[str, str] = {}
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member) if member.isfile() else None
            valid = (
                [t for t in json.loads(f.read()).get("tests") or [] if t.get("valid")] if f else []
            )
            if valid:
                examples[Path(member.name).stem] = json.dumps(valid[0]["data"])
    timed: dict[str, list[float]] = defaultdict(list)
    validators = Validators(len(schemas))
    for _, name, schema in schemas:
        for strict in (True, False):
            t0 = time.perf_counter()
            plan_schema(schema, strict)
            timed[f"plan {'strict' if strict else 'lenient'}"].append(time.perf_counter() - t0)
        if name in examples:
            constraint = Constraint(type="json_schema", value=schema, grammar="")
            for kind in ("check first", "check kept"):
                t0 = time.perf_counter()
                validators.check(constraint, examples[name])
                timed[kind].append(time.perf_counter() - t0)

    def ms(v: list[float], q: float) -> float:
        return round(sorted(v)[min(len(v) - 1, int(len(v) * q))] * 1000, 3)

    return {
        k: {"n": len(v), "p50": ms(v, 0.5), "p90": ms(v, 0.9), "p99": ms(v, 0.99), "max": ms(v, 1)}
        for k, v in timed.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="a running genq (default: start one with the sim engine)")
    ap.add_argument("--model", default="sim")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--tarball", default=str(DEFAULT_TARBALL))
    ap.add_argument(
        "--max-tokens", type=int, default=8000, help="per answer (the sim's context is 8192)"
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--limit", type=int, default=0, help="only the first N schemas")
    ap.add_argument("--costs", action="store_true", help="time the plan and the check only")
    args = ap.parse_args()
    if not Path(args.tarball).is_file():
        ap.error(f"no tarball at {args.tarball}: give --tarball")
    schemas = load(Path(args.tarball))[: args.limit or None]
    if args.costs:
        print(json.dumps(costs(schemas, Path(args.tarball)), indent=1))
        return
    if args.url:
        result = asyncio.run(run(args, args.url, schemas))
    else:
        with own_stack(args) as url:
            result = asyncio.run(run(args, url, schemas))
    print_table(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
