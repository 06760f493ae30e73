"""`cortexstream serve`: the OpenAI-compatible server (argument parsing and start-up)."""

from __future__ import annotations

import argparse
import os
import sys

from cortexstream.cli.distributed import add_rank_args
from cortexstream.cli.kv_storage import add_kv_storage_args, flag_errors


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, SSE streaming)")
    serve.add_argument("--model", default=None,
                       help="GGUF file, model directory or hub repo id (default: smollm2-135m)")
    serve.add_argument("--model-name", default=None, help="id the API serves the model as (default: from --model)")
    serve.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--kv-tokens", type=int, default=None, help="KV arena size in tokens (default 16384)")
    size.add_argument("--kv-memory", type=float, default=None, help="KV arena as a fraction of device memory")
    size.add_argument("--max-memory", default=None, metavar="SIZE|FRACTION",
                      help="one memory budget for the whole process (e.g. 6GiB, or 0.5 of physical memory): weights, "
                           "the process itself and the largest step's activations are taken from it and the KV arena "
                           "gets the rest; requests wait for blocks (429 only when --max-queue is full)")
    serve.add_argument("--block-size", type=int, default=16)
    add_kv_storage_args(serve)  # one arena, one storage type: fixed for every request
    serve.add_argument("--kv-disk", default=None, metavar="DIR",
                       help="keep prefix-cache KV blocks on disk in DIR too: they survive restarts and are read back "
                            "instead of recomputed (one server per DIR; an unusable DIR serves from RAM and says so)")
    serve.add_argument("--kv-disk-size", default="20GiB", metavar="SIZE",
                       help="most bytes the disk tier keeps in DIR, least recently used dropped first (default 20GiB)")
    serve.add_argument("--max-num-seqs", type=int, default=32)
    serve.add_argument("--max-queue", type=int, default=256, help="requests queued beyond max-num-seqs before 429")
    serve.add_argument("--kv-policy", default=None, help="default KV policy (anything parse_policy accepts)")
    serve.add_argument("--speculative", default=None, metavar="SPEC",
                       help="default speculative decoding: 'ngram:k=4,n=3' (prompt lookup) or "
                            "'draft:model=PATH,k=4' (a draft model with the same vocabulary, loaded at start); "
                            "requests may set their own 'speculative' field (docs/speculative.md)")
    keys = serve.add_mutually_exclusive_group()
    keys.add_argument("--api-key", action="append", default=None, help="accepted API key (repeatable)")
    keys.add_argument("--api-keys", default=None, help="file with one API key per line")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds running requests may finish after SIGTERM")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    serve.add_argument("--log-level", default="warning")
    add_rank_args(serve)


def model_name_for(source: str | None) -> str:
    from pathlib import Path

    from cortexstream.models.loader import DEFAULT_MODEL

    if source is None or source == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else (path.name or source)


def run_serve(args: argparse.Namespace) -> int:
    from cortexstream.backend import backend_info
    from cortexstream.models.loader import load
    from cortexstream.server import ServerConfig, create_app
    from cortexstream.server.auth import read_key_file
    from cortexstream.server.uvicorn_server import banner, serve_app

    api_keys = tuple(args.api_key or ()) or (read_key_file(args.api_keys) if args.api_keys else ())
    with flag_errors():
        config = ServerConfig(
            model_name=args.model_name or model_name_for(args.model), kv_tokens=args.kv_tokens,
            kv_memory=args.kv_memory, max_memory=args.max_memory, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_queue=args.max_queue, kv_policy=args.kv_policy, api_keys=api_keys,
            shutdown_timeout=args.shutdown_timeout, max_body_bytes=args.max_body_bytes,
            kv_dtype=args.kv_dtype, kv_group_size=args.kv_group_size, kv_disk=args.kv_disk,
            kv_disk_size=args.kv_disk_size, speculative=args.speculative,
        )  # validated before the model loads, so a bad option fails in a second
    from cortexstream.cli import distributed

    distributed.check_rank_args(args)
    model, tokenizer = load(args.model, dtype=args.dtype)
    failure = distributed.ServeFailure()
    ranks = distributed.join_ranks(args, model, tokenizer, failure)  # None unless a launcher started several ranks
    if ranks is not None and not ranks.is_leader:
        return distributed.follow(ranks)
    with flag_errors():  # what depends on the model, e.g. a group size that does not divide its head dim
        app = create_app(model, tokenizer, config)
    if ranks is not None:  # before the engine thread starts: every step runs on every rank
        try:
            ranks.attach(app.state.server.bridge.engine)
        except Exception as exc:
            ranks.close(str(exc))
            raise
        failure.mark = app.state.server.bridge.fail  # a rank that fails: 503 with the reason, then exit
    arena = app.state.server.bridge.engine.arena
    backend = backend_info()
    tenants = (f"{len(api_keys)} API keys, one prefix-cache tenant each (Authorization: Bearer required)"
               if api_keys else "no API keys: one tenant, every request may share cached prefixes")
    arena_text = (f"{arena.config.num_blocks} blocks x {arena.config.block_size} tokens = {arena.config.num_slots} "
                  f"tokens, {arena.config.total_bytes / 2**20:.0f} MiB ({arena.config.storage.text}, "
                  f"{arena.config.bytes_per_token:,} bytes/token)")
    engine = app.state.server.bridge.engine
    if engine.disk is not None:
        disk = engine.disk.stats()
        arena_text += (f"; disk tier {args.kv_disk}: {disk['disk_blocks']} blocks of this model, "
                       f"{disk['disk_bytes_on_disk'] / 2**20:.0f} MiB of {args.kv_disk_size}")
    elif engine.disk_problem is not None:
        arena_text += f"; disk tier OFF ({engine.disk_problem})"
    plan = app.state.server.memory_plan
    memory_line = f"\n  memory:  {plan.summary()}" if plan is not None else ""
    print(banner(f"http://{args.host}:{args.port}", config.model_name,
                 f"{'Metal GPU' if backend.metal else 'CPU backend'}, BLAS {backend.blas}, mlx {backend.mlx_version}", arena_text,
                 tenants) + memory_line, flush=True)
    # uvicorn's own header limit sits well above ours, so the middleware answers oversized headers with 413.
    code = serve_app(app, args.host, args.port, args.shutdown_timeout, 4 * config.max_header_bytes, args.log_level)
    if ranks is not None:
        ranks.close()  # the other ranks exit too
    print("cortexstream serve: stopped", file=sys.stderr, flush=True)
    # Every request and the engine thread are finished and the output is flushed. Skip the interpreter's teardown:
    # destroying MLX's and the engine's C++ state while a native worker thread is still winding down can abort
    # the process ("terminate called without an active exception", exit -6) after a clean shutdown.
    sys.stdout.flush()
    if ranks is not None:
        from cortexstream.distributed import finalize_mpi

        finalize_mpi()  # ranks joined over MPI: mpirun counts an exit without MPI_Finalize as a crash
    os._exit(code)
