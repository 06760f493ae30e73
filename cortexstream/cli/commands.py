"""Implementations of the CLI sub-commands (argument parsing lives in main.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cortexstream.generation.sampling import SamplingParams


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        seed=args.seed,
    )


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from cortexstream.models.loader import load

    return load(args.model, dequantize=False if args.keep_quantized else None, dtype=args.dtype)


def run_info(args: argparse.Namespace) -> int:
    import cortexstream
    from cortexstream.backend import backend_info, find_openblas
    from cortexstream.models.loader import DEFAULT_MODEL, default_model_path, load, model_info

    backend = backend_info()
    print(f"cortexstream {cortexstream.__version__}  (mlx {backend.mlx_version})")
    print(f"device:  {backend.device}  ({'Metal GPU' if backend.metal else 'CPU backend'})")
    print(f"blas:    {backend.blas}")
    if not backend.metal and "OpenBLAS" not in backend.blas:
        lib = find_openblas()
        hint = f"set LD_PRELOAD={lib}" if lib else "apt-get install libopenblas0-pthread"
        print(f"         (float32 matmul is 7-50x faster with OpenBLAS: {hint})")
    try:
        print(f"default model: {DEFAULT_MODEL} -> {default_model_path()}")
    except Exception as exc:
        print(f"default model: {DEFAULT_MODEL} -> not installed ({exc})")
    if args.model is not None:
        model, _ = load(args.model)
        for key, value in model_info(model).as_dict().items():
            print(f"  {key}: {value}")
    return 0


def _messages(system: str | None, history: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + history


def run_generate(args: argparse.Namespace) -> int:
    from cortexstream.generation.stream import stream_generate

    sampling = _sampling(args)
    model, tokenizer = _load(args)
    if args.no_chat_template or not getattr(tokenizer, "has_chat_template", False):
        prompt: Any = args.prompt
    else:
        prompt = _messages(args.system, [{"role": "user", "content": args.prompt}])
    last = None
    for response in stream_generate(model, tokenizer, prompt, sampling=sampling):
        sys.stdout.write(response.text)
        sys.stdout.flush()
        last = response
    sys.stdout.write("\n")
    if args.verbose and last is not None:
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s | "
            f"peak memory {last.peak_memory:.3f} GB | finish: {last.finish_reason}",
            file=sys.stderr,
        )
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from cortexstream.generation.stream import stream_generate

    sampling = _sampling(args)
    model, tokenizer = _load(args)
    history: list[dict[str, str]] = []
    print("cortexstream chat: type a message; /reset clears the conversation, /quit or Ctrl-D exits.")
    while True:
        try:
            line = input(">> ")
        except EOFError:
            print()
            return 0
        command = line.strip()
        if command in ("/quit", "/exit", "/q"):
            return 0
        if command == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        reply = []
        for response in stream_generate(model, tokenizer, _messages(args.system, history), sampling=sampling):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            reply.append(response.text)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_kind == "throughput":
        from cortexstream.benchmarks import throughput

        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        if not levels or any(c < 1 for c in levels):
            raise ValueError(f"--concurrency: '{args.concurrency}' must be positive integers separated by commas")
        payload = throughput.run(args.model, levels, args.prompt_tokens, args.max_tokens, args.out, args.repeats)
    else:
        from cortexstream.benchmarks import single_stream

        payload = single_stream.run(args.model, args.prompt_tokens, args.max_tokens, args.out, args.repeats)
    print(open(f"{args.out}/{payload['benchmark']}.md", encoding="utf-8").read())
    return 0


def run_tui(args: argparse.Namespace) -> int:
    from apps.tui.app import main as tui_main

    return tui_main(args)
