"""Diagnostic: does handing tokens to the event loop once per engine step (instead of once per token per request)
matter? Runs the server in-process twice per round, `handoff="per_step"` and `"per_token"`, alternating, with N
concurrent streaming clients, and prints output tokens/s for each.

    python -m bench.serve_handoff [--model SRC | --tiny] [--clients 32] [--max-tokens 64]

By default only the bridge is measured (asyncio consumers reading the events, no HTTP), which isolates the
hand-off; `--http` goes through uvicorn and streaming HTTP clients in the same process.
It first times the hop alone (no engine): a thread handing events to asyncio queues either way.
`--tiny` swaps in a random-weight 2-layer model (with the default model's tokenizer) whose steps take well under
a millisecond, so the hand-off's own cost is what is measured; with the real model it is diluted by the step.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

import uvicorn

from cortexstream.benchmarks.runner import run_as_script


def _tiny_like(tokenizer: Any) -> Any:
    import mlx.core as mx
    from mlx_lm.models import llama

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
              "vocab_size": len(tokenizer.get_vocab()), "rope_traditional": True, "tie_word_embeddings": True}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


async def _clients(url: str, clients: int, max_tokens: int) -> int:
    import json

    import httpx

    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Story number {i}: once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return tokens

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        return sum(await asyncio.gather(*(one(http, i) for i in range(clients))))


def measure(model: Any, tokenizer: Any, handoff: str, clients: int, max_tokens: int) -> float:
    from cortexstream.server import ServerConfig, create_app

    app = create_app(model, tokenizer, ServerConfig(model_name="m", kv_tokens=clients * (max_tokens + 64) + 1024,
                                                    max_num_seqs=clients, handoff=handoff))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        start = time.perf_counter()
        tokens = asyncio.run(_clients(url, clients, max_tokens))
        return tokens / (time.perf_counter() - start)
    finally:
        server.should_exit = True
        thread.join(30)


def measure_bridge(model: Any, tokenizer: Any, handoff: str, clients: int, max_tokens: int) -> float:
    """The hand-off alone: EventLoopBridge with `clients` requests read by asyncio consumers, no HTTP."""
    from cortexstream.engine.sampling import SamplingParams
    from cortexstream.server.app import build_engine
    from cortexstream.server.bridge import EngineJob, EventLoopBridge
    from cortexstream.server.config import ServerConfig

    config = ServerConfig(kv_tokens=clients * (max_tokens + 64) + 1024, max_num_seqs=clients)
    bridge = EventLoopBridge(build_engine(model, tokenizer, config), handoff=handoff)

    async def run() -> float:
        bridge.start(asyncio.get_running_loop())
        try:
            async def one(i: int) -> int:
                prompt = tokenizer.encode(f"Story number {i}: once upon a time")
                job = EngineJob([f"r{i}"], prompt, SamplingParams(max_tokens=max_tokens))
                handle = await bridge.submit(job)
                tokens = 0
                while not handle.finished:
                    event = await handle.events.get()
                    tokens += event.token is not None
                return tokens

            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(clients))))
            return tokens / (time.perf_counter() - start)
        finally:
            bridge.stop()

    return asyncio.run(run())


def measure_hops(mode: str, steps: int = 2000, per_step: int = 64) -> tuple[float, float]:
    """The hop alone, no engine: a thread hands `steps` x `per_step` events to asyncio queues, batched per step
    or one `call_soon_threadsafe` each. Returns (events/s delivered, CPU microseconds per event)."""

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(per_step)]

        def deliver(batch: list[tuple[int, int]]) -> None:
            for index, event in batch:
                queues[index].put_nowait(event)

        async def consume(queue: asyncio.Queue) -> None:
            for _ in range(steps):
                await queue.get()

        def produce() -> None:
            for step in range(steps):
                batch = [(i, step) for i in range(per_step)]
                if mode == "per_step":
                    loop.call_soon_threadsafe(deliver, batch)
                else:
                    for item in batch:
                        loop.call_soon_threadsafe(deliver, [item])

        wall, cpu = time.perf_counter(), time.process_time()
        producer = threading.Thread(target=produce)
        producer.start()
        await asyncio.gather(*(consume(q) for q in queues))
        producer.join()
        events = steps * per_step
        return events / (time.perf_counter() - wall), (time.process_time() - cpu) / events * 1e6

    return asyncio.run(run())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--http", action="store_true", help="through uvicorn + HTTP clients (default: bridge only)")


def run_from_args(args: argparse.Namespace) -> int:
    """Prints its figures (no result file)."""
    for mode in ("per_step", "per_token", "per_step", "per_token"):
        rate, cpu = measure_hops(mode, per_step=args.clients)
        print(f"hop only, {args.clients} streams: {mode:9s} {rate / 1e3:7.0f}k events/s, {cpu:.2f} us CPU/event")
    import cortexstream

    model, tokenizer = cortexstream.load(args.model)
    if args.tiny:
        model = _tiny_like(tokenizer)
    run = measure if args.http else measure_bridge
    run(model, tokenizer, "per_step", 4, 8)  # warm-up (graph caches, first-request costs)
    results: dict[str, list[float]] = {"per_step": [], "per_token": []}
    for round_index in range(args.rounds):
        order = ["per_step", "per_token"] if round_index % 2 == 0 else ["per_token", "per_step"]
        for handoff in order:
            results[handoff].append(run(model, tokenizer, handoff, args.clients, args.max_tokens))
            print(f"round {round_index}: {handoff:9s} {results[handoff][-1]:8.1f} output tok/s", flush=True)
    best = {k: max(v) for k, v in results.items()}
    print(f"best of {args.rounds}: per_step {best['per_step']:.1f} tok/s, per_token {best['per_token']:.1f} tok/s, "
          f"ratio {best['per_step'] / best['per_token']:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.serve_handoff")


if __name__ == "__main__":
    raise SystemExit(main())
