"""Option checks that must run before a command takes over the terminal or loads a model: sampling values and
the KV arena size against the memory of this machine, estimated from the model file's header alone.

The TUI starts its screen at once and loads the model on a thread, so a bad `--temp` or an arena that cannot fit
would otherwise surface inside the app (or as an out-of-memory kill) instead of as one line at the prompt.
"""

from __future__ import annotations

import argparse

from cortexstream.errors import InvalidArgumentError


def kv_bytes_per_token(source: str | None, itemsize: int, kv_dtype: str | None = None,
                       kv_group_size: int | None = None) -> int | None:
    """K+V bytes one token takes in an arena for the GGUF model `source` (None: not a GGUF, unknown), stored
    as `kv_dtype` when one is given (its group size must divide the head dim the header gives)."""
    from cortexstream.models.gguf_check import check_gguf
    from cortexstream.models.loader import DEFAULT_MODEL, default_model_path

    path = default_model_path() if source in (None, DEFAULT_MODEL) else source
    if not path.endswith(".gguf"):
        return None
    layout = check_gguf(path)  # also refuses a corrupt file here, before the screen starts
    values = layout.scalars
    arch = next((k.split(".")[0] for k in values if k.endswith(".block_count")), None)
    if arch is None:
        return None
    layers = int(values[f"{arch}.block_count"])
    heads = int(values.get(f"{arch}.attention.head_count", 0))
    kv_heads = int(values.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(values.get(f"{arch}.attention.key_length", 0)) or (
        int(values.get(f"{arch}.embedding_length", 0)) // heads if heads else 0)
    if kv_dtype is None and kv_group_size is None:
        return 2 * layers * kv_heads * head_dim * itemsize
    from cortexstream.kv.kv_dtype import parse_kv_dtype

    storage = parse_kv_dtype(kv_dtype, kv_group_size, model_dtype="float32" if itemsize == 4 else "float16")
    return storage.bytes_per_token(layers, kv_heads, head_dim)


def check_kv_tokens(kv_tokens: int, source: str | None, argument: str = "--kv-tokens", kv_dtype: str | None = None,
                    kv_group_size: int | None = None) -> None:
    """Refuse an arena of `kv_tokens` tokens (stored as `kv_dtype`) that cannot fit in this machine's memory,
    giving the numbers."""
    from cortexstream.backend import on_cpu
    from cortexstream.kv.arena_config import device_memory_bytes
    from cortexstream.kv.memory_check import check_kv_fits

    if not isinstance(kv_tokens, int) or isinstance(kv_tokens, bool) or kv_tokens < 1:
        raise InvalidArgumentError(f"{argument}: {kv_tokens!r} must be a positive integer")
    per_token = kv_bytes_per_token(source, 4 if on_cpu() else 2, kv_dtype, kv_group_size)
    if per_token is None:
        return
    check_kv_fits(kv_tokens, per_token, argument, device_memory_bytes())


def check_tui_options(args: argparse.Namespace) -> None:
    """Everything the TUI can check without the model, plus the arena size (and a GGUF model's head dim against
    --kv-group-size) from the model file's header."""
    from cortexstream.cli.kv_storage import flag_errors, kv_storage_options
    from cortexstream.engine.sampling import SamplingParams

    SamplingParams(temperature=args.temp, repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens)
    if not isinstance(args.block_size, int) or args.block_size < 1:
        raise InvalidArgumentError(f"--block-size: {args.block_size!r} must be a positive integer")
    kv_dtype, kv_group_size = kv_storage_options(args)
    with flag_errors():
        check_kv_tokens(args.kv_tokens, args.model, kv_dtype=kv_dtype, kv_group_size=kv_group_size)
    from cortexstream.engine.speculative_config import parse_speculative

    parse_speculative(getattr(args, "speculative", None))
    if getattr(args, "kv_disk_size", None) is not None:
        from cortexstream.kv.disk import parse_size

        parse_size(args.kv_disk_size, "--kv-disk-size")
