"""The `genq` command: serve, gateway, worker, submit, batch, bench (and the engine's extras)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, get_args

from genq import batch as batch_cli
from shared import logs
from shared.settings import GatewaySettings, LogLevel, RedisSettings, Settings

DEFAULT_PORT = 8000


def _given(flags: dict[str, Any]) -> dict[str, Any]:
    """The command-line flags given, to lay over the GENQ_* variables."""
    return {k: v for k, v in flags.items() if v is not None}


def _settings(**overrides: Any) -> Settings:
    """Settings from GENQ_* variables, with command-line flags (those given) on top."""
    return Settings(**_given(overrides))


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=["sim", "exllamav2"],
        help="default: sim, or exllamav2 when --model is given",
    )
    p.add_argument("--model", dest="model_dir", help="model directory (exllamav2 engine)")
    p.add_argument("--model-name", help="name clients ask for (default: sim / the folder name)")
    p.add_argument("--step-ms", type=float, dest="sim_step_ms", help="sim: decode step time")
    p.add_argument("--max-batch", type=int, help="jobs generated at once")
    p.add_argument("--cache-tokens", type=int, dest="cache_tokens", help="exllamav2: cache size")
    p.add_argument("--cache-mode", choices=["FP16", "Q4", "Q6", "Q8"], help="exllamav2")
    p.add_argument("--max-seq-len", type=int, dest="max_seq_len", help="exllamav2")
    p.add_argument("--max-chunk-size", type=int, help="exllamav2: prefill chunk")
    p.add_argument("--gpu-split", help="exllamav2: GB per GPU, e.g. 20,24 (default: autosplit)")


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
        "or 'auto' (as many as memory and CPU allow, at most 4); --max-batch and "
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
    out["engine"] = a.engine or ("exllamav2" if a.model_dir else None)
    return {k: v for k, v in out.items() if k in Settings.model_fields}


def _log_level_flag(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument(
        "--log-level",
        choices=get_args(LogLevel),
        default=default,
        help="least level logged (default: GENQ_LOG_LEVEL, else info)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genq", description=__doc__)
    _log_level_flag(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="gateway + worker in one process (dev, demos, one GPU)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    _engine_flags(p)
    _launcher_flags(p, default_procs="auto")

    p = sub.add_parser("gateway", help="the HTTP gateway (stateless; run as many as you like)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--workers", type=int, default=1, help="uvicorn processes")

    p = sub.add_parser("worker", help="a generation worker (one per GPU)")
    _engine_flags(p)
    _launcher_flags(p, default_procs="1")

    p = sub.add_parser("submit", help="submit one prompt and print its text")
    p.add_argument("prompt")
    p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}")
    p.add_argument("--model", default="sim")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--priority", choices=["interactive", "batch"], default="interactive")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--api-key")

    p = sub.add_parser("bench", help="load generator: concurrent streaming clients")
    p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}")
    p.add_argument("--model", default="sim")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--priority", choices=["interactive", "batch"], default="interactive")
    p.add_argument("--api-key")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")

    batch_cli.add_parser(sub)

    p = sub.add_parser("synth-model", help="write a random-weight Llama model (tests, planning)")
    p.add_argument("dir")
    p.add_argument("--shape", choices=["tiny", "1b", "8b"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    for command in sub.choices.values():
        # after the command too; SUPPRESS keeps a value given before it
        _log_level_flag(command, default=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # into every command's settings: the processes a command starts take it from there
    level = {"log_level": args.log_level}
    logs.setup(RedisSettings(**_given(level)))
    if args.command == "serve":
        from genq.serve import serve

        settings = _settings(**level, **_engine_settings(args))
        return serve(settings, args.host, args.port, args.gpus, args.procs_per_gpu)
    if args.command == "gateway":
        from gateway.server import run_gateway

        run_gateway(GatewaySettings(**_given(level)), args.host, args.port, args.workers)
        return 0
    if args.command == "worker" and (args.gpus or args.procs_per_gpu != "1"):
        from genq.launcher import run as launch

        settings = _settings(**level, **_engine_settings(args))
        return launch(settings, args.gpus, args.procs_per_gpu)
    if args.command == "worker":
        from worker.process import run

        return run(_settings(**level, **_engine_settings(args)))
    if args.command == "submit":
        from genq.submit import submit

        return submit(args)
    if args.command == "bench":
        from genq.bench import main as bench

        return bench(args)
    if args.command == "batch":
        return batch_cli.main(args)
    if args.command == "synth-model":
        from genq.synth import synth_model

        print(synth_model(args.dir, args.shape, args.seed))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
