"""The `genq` command: serve, gateway, worker, submit, batch, bench (and the engine's extras)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, TypeVar, get_args

from pydantic import ValidationError
from pydantic_core import PydanticUndefined

from genq import batch as batch_cli
from genq.client import add_api_key_flag, add_url_flag
from shared import __version__, lifeline, logs
from shared.settings import GatewaySettings, LogLevel, RedisSettings, Settings, WorkerSettings

DEFAULT_PORT = 8000
DEFAULT_EXL3_BITS = 4.0
_S = TypeVar("_S", bound=RedisSettings)


def _load(cls: type[_S], **overrides: Any) -> _S:
    """Settings from GENQ_* variables, with command-line flags (those given) on top; a bad
    value stops the command with one line naming its variable."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return cls(**given)
    except ValidationError as exc:
        raise SystemExit(f"genq: error: {_invalid(exc)}") from None


def _settings(**overrides: Any) -> Settings:
    return _load(Settings, **overrides)


def _invalid(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        msg = e["msg"].removeprefix("Value error, ")
        # a whole-settings check names its variable itself
        parts.append(f"GENQ_{str(e['loc'][0]).upper()}: {msg}" if e["loc"] else msg)
    return "; ".join(parts)


def _need_redis(settings: RedisSettings, command: str) -> None:
    """SystemExit with one line when `command`'s settings name no Redis, or a URL with an
    option its transport does not take."""
    if not settings.redis_configured:
        raise SystemExit(
            f"genq: error: genq {command} needs a Redis: --redis-url redis://HOST:6379/0, "
            "GENQ_REDIS_URL or GENQ_REDIS_SENTINELS (genq serve runs one of its own)"
        )
    if settings.redis_url:
        from shared.redisconn import check_url

        try:
            check_url(settings.redis_url)
        except ValueError as exc:  # the message names the option, never the URL's password
            raise SystemExit(f"genq: error: GENQ_REDIS_URL: {exc}") from None


def _redis_flag(p: argparse.ArgumentParser, embedded: bool = False) -> None:
    p.add_argument(
        "--redis-url",
        help="the shared Redis, redis://[:PASSWORD@]HOST:6379/0 (rediss:// for TLS)"
        + ("; unset: a private redis-server, else in-process fakeredis" if embedded else ""),
    )


def _describe_defaults(parser: argparse.ArgumentParser) -> None:
    """Append to each flag's help its default and, where a setting backs it, its variable:
    `(default: 256; env GENQ_MAX_BATCH)`. A flag whose dest names a Settings field is that
    setting (given, it overrides the variable), so both come from the field."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _describe_defaults(sub)
            continue
        if not action.help or action.help == argparse.SUPPRESS or action.nargs == 0:
            continue
        field = Settings.model_fields.get(action.dest) if action.option_strings else None
        default = action.default
        if field is not None:
            default = field.get_default(call_default_factory=True)
        parts = []
        if default not in (None, PydanticUndefined) and "default:" not in action.help:
            parts.append(f"default: {default}".replace("%", "%%"))
        if field is not None:
            parts.append(f"env GENQ_{action.dest.upper()}")
        if parts:
            action.help += f" ({'; '.join(parts)})"


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=["sim", "exllamav2", "exllamav3"],
        help="default: sim; with --model, as the folder says (EXL3: exllamav3, EXL2: "
        "exllamav2, plain fp16/bf16: the faster one)",
    )
    p.add_argument("--model", dest="model_dir", help="model directory (exllamav2/exllamav3)")
    p.add_argument("--model-name", help="name clients ask for (default: sim / the folder name)")
    p.add_argument("--step-ms", type=float, dest="sim_step_ms", help="sim: decode step, ms")
    p.add_argument("--max-batch", type=int, help="jobs generated at once")
    p.add_argument(
        "--cache-tokens",
        type=int,
        dest="cache_tokens",
        help="K/V cache size in tokens (default: fit the batch)",
    )
    p.add_argument("--cache-mode", choices=["FP16", "Q4", "Q6", "Q8"], help="K/V cache precision")
    p.add_argument(
        "--max-seq-len",
        type=int,
        dest="max_seq_len",
        help="most tokens (prompt + output) of one job (default: the model's)",
    )
    p.add_argument("--max-chunk-size", type=int, help="prefill chunk, tokens")
    p.add_argument("--gpu-split", help="GB per GPU, e.g. 20,24 (default: autosplit)")


def _launcher_flags(p: argparse.ArgumentParser, default_procs: str) -> None:
    p.add_argument(
        "--gpus",
        help="GPUs to run on, e.g. 0,1: a supervised set of worker "
        "processes per GPU (default: the visible ones)",
    )
    p.add_argument(
        "--procs-per-gpu",
        default=default_procs,
        help="worker processes per GPU, "
        "or 'auto' (as many as memory and CPU allow, at most "
        f"{WorkerSettings.model_fields['auto_procs_max'].default}; 4 without GPU sampling; "
        "GENQ_AUTO_PROCS_MAX sets the first); "
        "--max-batch and "
        f"--cache-tokens are per GPU, shared among them (default: {default_procs})",
    )
    p.add_argument(
        "--cpu-affinity",
        choices=["auto", "on", "off"],
        help="pin each worker process to cores of its own, near its GPU (auto: with several "
        "exllamav2 processes)",
    )


def _engine_settings(a: argparse.Namespace) -> dict[str, Any]:
    keys = [
        "model_dir",
        "model_name",
        "sim_step_ms",
        "max_batch",
        "cache_tokens",
        "cache_mode",
        "max_seq_len",
        "max_chunk_size",
        "gpu_split",
        "cpu_affinity",
    ]
    out = {k: getattr(a, k, None) for k in keys}
    out["engine"] = a.engine  # left out: sim, or what the model folder calls for (settings)
    return {k: v for k, v in out.items() if k in Settings.model_fields}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genq", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _log_level_flag(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="gateway + worker in one process (dev, demos, one GPU)")
    _listen_flags(p)
    _redis_flag(p, embedded=True)
    data = p.add_mutually_exclusive_group()
    data.add_argument(
        "--data-dir",
        type=Path,
        help="where the private redis-server keeps its data, across restarts (default: "
        "$XDG_DATA_HOME/genq/redis, else ~/.local/share/genq/redis)",
    )
    data.add_argument(
        "--ephemeral",
        action="store_true",
        help="the private redis-server keeps nothing: its data goes when genq serve stops",
    )
    _engine_flags(p)
    _launcher_flags(p, default_procs="auto")

    p = sub.add_parser("gateway", help="the HTTP gateway (stateless; run as many as you like)")
    _listen_flags(p)
    p.add_argument("--workers", type=int, default=1, help="uvicorn processes sharing the port")
    _redis_flag(p)

    p = sub.add_parser("worker", help="a generation worker (one per GPU)")
    _redis_flag(p)
    _engine_flags(p)
    _launcher_flags(p, default_procs="1")

    p = sub.add_parser("submit", help="submit one prompt and print its text")
    p.add_argument("prompt", help="the prompt text")
    _client_flags(p, max_tokens=64)
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the API's)")
    p.add_argument("--seed", type=int, help="sampling seed (default: none)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")

    p = sub.add_parser("bench", help="load generator: concurrent streaming clients")
    _client_flags(p, max_tokens=200)
    p.add_argument("--concurrency", type=int, default=64, help="clients streaming at once")
    p.add_argument("--requests", type=int, default=256, help="requests in all")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of each request")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--api",
        choices=["native", "openai", "chat", "responses"],
        default="native",
        help="route: native POST /v1/jobs, openai /v1/completions, chat /v1/chat/completions, "
        "responses /v1/responses",
    )
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        help="every request constrained to this JSON schema (native and openai: `json_schema`; "
        "chat: `response_format`)",
    )

    batch_cli.add_parser(sub)

    p = sub.add_parser("synth-model", help="write a random-weight Llama model (tests, planning)")
    p.add_argument("dir", help="folder to write (a new one, or an earlier synth-model folder)")
    p.add_argument("--shape", choices=["tiny", "1b", "8b"], default="tiny", help="model shape")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--quantize",
        choices=["exl3"],
        help="convert to EXL3 with exllamav3's converter (GPU): the model of --source, or a "
        "new synth model of --shape",
    )
    p.add_argument("--bits", type=float, default=DEFAULT_EXL3_BITS, help="EXL3 bits per weight")
    p.add_argument("--source", help="with --quantize: an fp16 model folder to convert")
    p.add_argument("--gpus", help="with --quantize: GPUs to convert on, e.g. 0,1 (default: 0)")
    p.add_argument(
        "--calibration-rows",
        type=_positive_int,
        help="with --quantize: rows of 2,048 calibration tokens (default: the converter's, 250); "
        "fewer convert faster, and random weights have nothing to calibrate",
    )
    p.add_argument(
        "--random-trellis",
        action="store_true",
        help="with --quantize exl3: write the EXL3 storage directly, random bits of --shape "
        "(any machine, seconds; the same speed as a converted model) instead of converting",
    )
    p = sub.add_parser("settings", help="every GENQ_ setting: default, who reads it, meaning")
    p.add_argument("--markdown", action="store_true", help="as the table in docs/settings.md")
    for command in sub.choices.values():
        # after the command too; SUPPRESS keeps a value given before it
        _log_level_flag(command, default=argparse.SUPPRESS)
    _describe_defaults(parser)
    return parser


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return n


def _log_level_flag(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument(
        "--log-level", choices=get_args(LogLevel), default=default, help="least level logged"
    )


def _listen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")


def _client_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    add_url_flag(p)
    p.add_argument("--model", default="sim", help="model name")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per request")
    p.add_argument(
        "--priority", choices=["interactive", "batch"], default="interactive", help="queue"
    )
    add_api_key_flag(p)


BROKEN_PIPE_EXIT = 128 + 13
"""Exit status when stdout's reader left (`genq batch list | head -1`): what a shell reports
for a program killed by SIGPIPE, the usual end of a command whose output was cut short."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()  # here, not at exit: a reader that left is told apart below
    except BrokenPipeError:
        # The reader has what it wanted; nothing to say. stdout goes to /dev/null so that
        # the interpreter's own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT
    return status


def _run(args: argparse.Namespace) -> int:
    # into every command's settings: the processes a command starts take it from there
    level = {"log_level": args.log_level}
    logs.setup(_load(RedisSettings, **level))
    if args.command == "serve":
        from genq.embedded_redis import default_data_dir
        from genq.serve import plan_serve, serve
        from worker.process import check_engine

        settings = _settings(**level, **_engine_settings(args), redis_url=args.redis_url)
        plan = plan_serve(settings, args.gpus, args.procs_per_gpu)  # refuses what cannot fit
        check_engine(settings)
        data_dir = None if args.ephemeral else (args.data_dir or default_data_dir())
        return serve(
            settings,
            args.host,
            args.port,
            args.gpus,
            args.procs_per_gpu,
            data_dir,
            data_dir_chosen=args.data_dir is not None,
            plan=plan,
        )
    if args.command == "gateway":
        return _gateway(args, level)
    if args.command == "worker":
        return _worker(args, level)
    if args.command == "submit":
        from genq.submit import submit

        return submit(args)
    if args.command == "bench":
        from genq.bench import main as bench

        return bench(args)
    if args.command == "batch":
        return batch_cli.main(args)
    if args.command == "synth-model":
        return _synth_model(args)
    if args.command == "settings":
        from genq import settings_doc

        print(settings_doc.markdown() if args.markdown else settings_doc.plain(), end="")
        return 0
    return 2


def _synth_model(args: argparse.Namespace) -> int:
    from genq.synth import quantize_exl3, synth_model

    if args.random_trellis:
        if args.quantize is None:
            raise SystemExit("genq: error: --random-trellis goes with --quantize exl3")
        given = [f for f in ("source", "gpus", "calibration_rows") if getattr(args, f)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise SystemExit(f"genq: error: {flag} is for a conversion, not --random-trellis")
        print(synth_model(args.dir, args.shape, args.seed, exl3_bits=args.bits))
    elif args.quantize is None:
        print(synth_model(args.dir, args.shape, args.seed))
    else:
        print(
            quantize_exl3(
                args.dir,
                args.bits,
                args.source,
                args.shape,
                args.seed,
                args.gpus,
                args.calibration_rows,
            )
        )
    return 0


def _gateway(args: argparse.Namespace, level: dict[str, Any]) -> int:
    from gateway.server import listen, run_gateway, url_of

    settings = _load(GatewaySettings, **level, redis_url=args.redis_url)
    _need_redis(settings, "gateway")
    if settings.redis_url:  # each uvicorn process builds its settings from GENQ_*: the flag
        os.environ["GENQ_REDIS_URL"] = settings.redis_url  # must reach them
    sock = listen(args.host, args.port)
    print(f"genq gateway on {url_of(sock)}  ({args.workers} process(es))", flush=True)
    run_gateway(settings, sock, args.workers)
    return 0


def _worker(args: argparse.Namespace, level: dict[str, Any]) -> int:
    early = lifeline.record_stops()  # a supervisor's SIGTERM while this starts ends the start
    from worker.process import check_engine

    # its own sections only: a gateway's files (GENQ_API_KEYS_FILE, …) need not exist here
    settings = _load(WorkerSettings, **level, **_engine_settings(args), redis_url=args.redis_url)
    _need_redis(settings, "worker")
    from genq.gpu_share import check_fits
    from genq.launcher import Launcher, parse_gpus, resolve_procs

    # before anything loads: the processes must fit their GPUs (one line otherwise)
    gpus = parse_gpus(args.gpus)
    procs = resolve_procs(settings, gpus, args.procs_per_gpu)
    memory = check_fits(settings, gpus, procs)
    check_engine(settings)
    if args.gpus or args.procs_per_gpu != "1":
        return Launcher(settings, gpus, procs, memory=memory).run(early)
    from worker.process import run

    return run(settings, early)


if __name__ == "__main__":
    sys.exit(main())
