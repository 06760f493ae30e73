"""Implementations of the CLI sub-commands (argument parsing lives in main.py)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

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
        from cortexstream.cli.kv_storage import storage_lines, storage_rows

        model, _ = load(args.model)
        for key, value in model_info(model).as_dict().items():
            print(f"  {key}: {value}")
        print("\n".join(storage_lines(storage_rows(model))))
    return 0


def _messages(system: str | None, history: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + history


def _kv_policy(args: argparse.Namespace) -> Any:
    """Parse --kv-policy before the model loads, so a typo fails fast with the bad key named."""
    from cortexstream.policies import parse_policy

    return parse_policy(getattr(args, "kv_policy", None))


def run_generate(args: argparse.Namespace) -> int:
    from cortexstream.cli.kv_storage import check_for_model, kv_storage_options
    from cortexstream.generation.stream import stream_generate

    from cortexstream.engine.speculative_config import parse_speculative

    from cortexstream.cli import distributed

    sampling = _sampling(args)
    policy = _kv_policy(args)
    kv_dtype, kv_group_size = kv_storage_options(args)
    parse_speculative(args.speculative)  # before the model loads
    distributed.check_rank_args(args)
    model, tokenizer = _load(args)
    check_for_model(model, kv_dtype, kv_group_size)
    ranks = distributed.join_ranks(args, model, tokenizer)  # None unless a launcher started several ranks
    if ranks is not None and not ranks.is_leader:
        return distributed.follow(ranks)
    if args.no_chat_template or not getattr(tokenizer, "has_chat_template", False):
        prompt: Any = args.prompt
    else:
        prompt = _messages(args.system, [{"role": "user", "content": args.prompt}])
    last = None
    with ranks if ranks is not None else contextlib.nullcontext():  # leaving it stops the other ranks
        engine = None if ranks is None else distributed.generate_engine(ranks, model, tokenizer, prompt, sampling,
                                                                        policy, kv_dtype, kv_group_size,
                                                                        args.speculative)
        for response in stream_generate(model, tokenizer, prompt, sampling=sampling, kv_policy=policy,
                                        context_overflow=args.context_overflow, kv_dtype=kv_dtype,
                                        kv_group_size=kv_group_size, speculative=args.speculative, engine=engine):
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

    def __init__(self, model: Any, tokenizer: Any, policy: Any, kv_dtype: str | None = None,
                 kv_group_size: int | None = None) -> None:
        self.model, self.tokenizer, self.policy = model, tokenizer, policy
        self.storage = {"kv_dtype": kv_dtype, "kv_group_size": kv_group_size}  # of every cache it makes
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
            self.cache = make_prompt_cache(self.model, **self.storage)
            tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
        self.fed_text = text
        self._offset = self.cache[0].offset + len(tokens)
        return tokens

    def after_reply(self, reply_tokens: list[int]) -> None:
        fed = self.cache[0].offset - self._offset  # the last sampled token may not have been fed
        self.fed_text += self.tokenizer.decode(reply_tokens[:fed])


def run_chat(args: argparse.Namespace) -> int:
    from cortexstream.cli.kv_storage import check_for_model, kv_storage_options

    sampling = _sampling(args)
    policy = _kv_policy(args)
    kv_dtype, kv_group_size = kv_storage_options(args)
    model, tokenizer = _load(args)
    check_for_model(model, kv_dtype, kv_group_size)  # here, not as an error on every turn
    chat_cache = _ChatCache(model, tokenizer, policy, kv_dtype, kv_group_size)
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


def run_tui(args: argparse.Namespace) -> int:
    from cortexstream.cli.preflight import check_tui_options

    check_tui_options(args)  # before the screen is taken over
    from cortexstream.tui.app import main as tui_main

    return tui_main(args)
