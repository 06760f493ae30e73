"""Implementations of the CLI sub-commands (argument parsing lives in main.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cortexstream.cli.number_lists import at_least, fraction_list, int_list
from cortexstream.errors import CortexStreamError
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.text_input import has_surrogates, repair_text


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
    from cortexstream.kernels.dispatch import kernel_backend_description

    print(f"kernels: {kernel_backend_description()}")
    if not backend.metal:
        from cortexstream.kernels.mlx_jit import active as jit_flags_active

        print(f"mlx jit: {'vectorised (g++ wrapper, kernels/mlx_jit.py)' if jit_flags_active() else 'MLX default flags'}")
        from cortexstream.backend import DEFAULT_MAX_ROWS
        from cortexstream.kernels.small_gemm import interposer, library_path

        state = (f"preloaded: the engine's decode matmuls with up to {DEFAULT_MAX_ROWS} rows use it"
                 if interposer() is not None
                 else "not preloaded" + ("" if library_path() else " (no C compiler, or CORTEXSTREAM_NO_SMALL_GEMM)"))
        print(f"small-batch matmul: {state}")
    from cortexstream.backend import ComputeBackend

    compute = ComputeBackend.for_engine("auto")  # what an Engine built now would run on
    print(f"compute backend: {compute.describe()}")
    compute.close()
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


def _kv_policy(args: argparse.Namespace) -> Any:
    """Parse --kv-policy before the model loads, so a typo fails fast with the bad key named."""
    from cortexstream.policies import parse_policy

    return parse_policy(getattr(args, "kv_policy", None))


def run_generate(args: argparse.Namespace) -> int:
    from cortexstream.generation.stream import stream_generate

    sampling = _sampling(args)
    policy = _kv_policy(args)
    model, tokenizer = _load(args)
    if args.no_chat_template or not getattr(tokenizer, "has_chat_template", False):
        prompt: Any = args.prompt
    else:
        prompt = _messages(args.system, [{"role": "user", "content": args.prompt}])
    last = None
    for response in stream_generate(model, tokenizer, prompt, sampling=sampling, kv_policy=policy,
                                    context_overflow=args.context_overflow):
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


class _ChatCache:
    """The chat's persistent prompt cache: each turn feeds only the part of the templated conversation that the
    cache lacks, so an evicted cache is continued, never recomputed (the text itself is kept in `history`).

    The cache has seen `fed_text` (the templated history plus the reply tokens it computed); when the new
    templated conversation starts with it, the rest is encoded and fed. Otherwise (a template that rewrites old
    turns) the conversation is recomputed on a fresh cache: correct, only slower.
    """

    def __init__(self, model: Any, tokenizer: Any, policy: Any) -> None:
        self.model, self.tokenizer, self.policy = model, tokenizer, policy
        self.reset()

    def reset(self) -> None:
        self.cache: list[Any] | None = None
        self.fed_text = ""

    def turn_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        from cortexstream.kv.prompt_cache import make_prompt_cache

        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if self.cache is not None and self.fed_text and text.startswith(self.fed_text):
            tokens = list(self.tokenizer.encode(text[len(self.fed_text):], add_special_tokens=False))
        else:
            self.cache = make_prompt_cache(self.model)
            tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
        self.fed_text = text
        self._offset = self.cache[0].offset + len(tokens)
        return tokens

    def after_reply(self, reply_tokens: list[int]) -> None:
        fed = self.cache[0].offset - self._offset  # the last sampled token may not have been fed
        self.fed_text += self.tokenizer.decode(reply_tokens[:fed])


def run_chat(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    policy = _kv_policy(args)
    model, tokenizer = _load(args)
    chat_cache = _ChatCache(model, tokenizer, policy)
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
            chat_cache.reset()
            print("(conversation cleared)")
            continue
        if not command:
            continue
        if has_surrogates(line):
            line = repair_text(line)
            print("(undecodable bytes in that line were replaced by \ufffd)", file=sys.stderr)
        try:
            reply = _chat_turn(model, tokenizer, sampling, policy, chat_cache, _messages(args.system, history), line,
                               args.context_overflow)
        except Exception as exc:  # noqa: BLE001 - one bad line must not end the session
            kind = "" if isinstance(exc, CortexStreamError) else f"{type(exc).__name__}: "
            print(f"cortexstream: error: {kind}{exc} (line ignored; the conversation goes on)", file=sys.stderr)
            chat_cache.reset()  # the cache may hold part of the failed turn; the history is replayed next turn
            continue
        history.extend([{"role": "user", "content": line}, {"role": "assistant", "content": reply}])


def _chat_turn(model: Any, tokenizer: Any, sampling: SamplingParams, policy: Any, chat_cache: "_ChatCache",
               history: list[dict[str, str]], line: str, context_overflow: str = "warn") -> str:
    from cortexstream.generation.stream import stream_generate

    reply, reply_tokens = [], []
    tokens = chat_cache.turn_tokens(history + [{"role": "user", "content": line}])
    for response in stream_generate(model, tokenizer, tokens, sampling=sampling, prompt_cache=chat_cache.cache,
                                    context_overflow=context_overflow,
                                    kv_policy=policy):
        sys.stdout.write(response.text)
        sys.stdout.flush()
        reply.append(response.text)
        reply_tokens.append(response.token)
    chat_cache.after_reply(reply_tokens)
    sys.stdout.write("\n")
    return "".join(reply)


def run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "out", None):
        from cortexstream.atomic_files import check_output_dir

        check_output_dir(args.out)  # before a long run, not after it: results must have somewhere to go
    if args.bench_kind == "throughput":
        from cortexstream.benchmarks import throughput

        return throughput.run_from_args(args)
    elif args.bench_kind == "quality":
        return _run_bench_quality(args)
    elif args.bench_kind == "frontier":
        return _run_bench_frontier(args)
    elif args.bench_kind == "c2c":
        from cortexstream.benchmarks import c2c

        return c2c.run_from_args(args)
    elif args.bench_kind == "kernels":
        from cortexstream.benchmarks import kernels

        kernels.run(args.out, repeats=args.repeats)
        print(open(f"{args.out}/kernels.md", encoding="utf-8").read())
        return 0
    else:
        from cortexstream.benchmarks import single_stream

        for option in ("prompt_tokens", "max_tokens", "repeats"):
            at_least(getattr(args, option), "--" + option.replace("_", "-"), 1)
        payload = single_stream.run(args.model, args.prompt_tokens, args.max_tokens, args.out, args.repeats)
    print(open(f"{args.out}/{payload['benchmark']}.md", encoding="utf-8").read())
    return 0


def _run_bench_quality(args: argparse.Namespace) -> int:
    from cortexstream.benchmarks import quality
    from cortexstream.policies import parse_policy

    contexts = int_list(args.contexts, "--contexts", 16)
    passkey_contexts = int_list(args.passkey_contexts, "--passkey-contexts", 16)
    budgets = fraction_list(args.budgets, "--budgets")
    for option in ("ppl_chunk", "passkey_trials", "passkey_chunk", "stream_tokens", "stream_cache"):
        at_least(getattr(args, option), "--" + option.replace("_", "-"), 1)
    specs = tuple(p.strip() for p in args.passkey_policies.split(";") if p.strip())
    for spec in specs:
        parse_policy(spec)  # fail before loading anything
    quality.run(
        args.model, args.out, quick=args.quick, contexts=contexts, budgets=budgets, ppl_chunk=args.ppl_chunk,
        passkey_contexts=passkey_contexts, passkey_policies=specs, passkey_trials=args.passkey_trials,
        passkey_chunk=args.passkey_chunk, stream_tokens=args.stream_tokens, stream_cache=args.stream_cache,
        parts=tuple(p.strip() for p in args.parts.split(",") if p.strip()), resume=args.resume,
        max_minutes=args.max_minutes,
    )
    name = "quality_quick" if args.quick else "quality"
    print(open(f"{args.out}/{name}.md", encoding="utf-8").read())
    return 0


def _run_bench_frontier(args: argparse.Namespace) -> int:
    from cortexstream.benchmarks import frontier

    def specs(text: str) -> tuple[str, ...]:
        return tuple(p.strip() for p in text.split(";") if p.strip())

    contexts = int_list(args.contexts, "--contexts", 16)
    for option in ("chunk", "passkey_context", "passkey_trials", "needle_context", "needle_trials"):
        at_least(getattr(args, option), "--" + option.replace("_", "-"), 1)
    name = "frontier_quick" if args.quick else "frontier"
    frontier.run(
        args.model, args.out, contexts=(256,) if args.quick else contexts, policies=specs(args.policies),
        chunk=args.chunk, match=not args.no_match, passkey_policies=specs(args.passkey_policies),
        passkey_context=256 if args.quick else args.passkey_context,
        passkey_trials=3 if args.quick else args.passkey_trials, needle_policies=specs(args.needle_policies),
        needle_context=args.needle_context, needle_trials=args.needle_trials, resume=args.resume,
        max_minutes=args.max_minutes, name=name,
    )
    print(open(f"{args.out}/{name}.md", encoding="utf-8").read())
    return 0


def run_tui(args: argparse.Namespace) -> int:
    from cortexstream.cli.preflight import check_tui_options

    check_tui_options(args)  # before the screen is taken over
    from cortexstream.tui.app import main as tui_main

    return tui_main(args)
