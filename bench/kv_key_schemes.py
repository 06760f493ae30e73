"""How 4-bit keys should be laid out: perplexity per key quantization scheme (`python -m bench.kv_key_schemes`).

A diagnostic for issue #32's int4 target on Qwen2.5-Coder-0.5B, whose keys carry a large k_proj bias. Each scheme
quantizes the keys (4 bits, values kept in float) as they enter mlx-lm's plain `KVCache` and reads them back
dequantized, so only the rounding differs between rows, on the same text (`wiki_corpus.wiki_text`, chunks of 256):
- `per_token` rows: the arena's layout, one scale and bias per group of `group` channels of one token; keys as
  they are (`raw`), minus the layer's key bias (`centered`, kv_center.py), centered then rotated (kv_rotation.py).
- `per_token, centered, equalized`: centered keys divided per channel by a fixed scale before quantizing and
  multiplied back after: each channel's largest magnitude over `--calibration` tokens of text after the scored
  ones (shared by the two channels of a RoPE pair). The scale comes from data, not weights.
- `per_channel`: one scale and bias per channel per group of 32 tokens (the KIVI layout), and per block of 16
  tokens, quantized whole or grown token by token as decode fills a block (every stored value of the block
  requantized when its range grows): the layout the arena now keeps for 4-bit keys (kv/channel_quantized.py).
- `arena` rows: the engine's own arena storage (make_prompt_cache) with keys int4 and values float32: grouped per
  token (centered; rotated too), and per channel over blocks of 16 (the default for 4-bit keys).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from cortexstream.benchmarks.common import write_results
from cortexstream.benchmarks.machine import machine, machine_sentence
from cortexstream.benchmarks.runner import run_as_script

KeyFn = Callable[[int, Any], Any]  # (layer, keys [B, H, T, D]) -> keys as read back
CHUNK = 256


def key_hooked_cache(layers: int, fn: KeyFn) -> list[Any]:
    """One mlx-lm `KVCache` per layer that stores `fn(layer, keys)` in place of the keys it is given."""
    from mlx_lm.models.cache import KVCache

    class KeyHooked(KVCache):
        def __init__(self, layer: int) -> None:
            super().__init__()
            self.layer = layer

        def update_and_fetch(self, keys: Any, values: Any) -> Any:
            return super().update_and_fetch(fn(self.layer, keys).astype(keys.dtype), values)

    return [KeyHooked(i) for i in range(layers)]


class KeyStats:
    """The model's key geometry, its key bias per layer, and per-channel key magnitudes of calibration text."""

    def __init__(self, model: Any, calibration: list[int]) -> None:
        import mlx.core as mx

        from cortexstream.evaluation.perplexity import token_nlls
        from cortexstream.kv.arena_config import model_kv_shape

        _, self.heads, self.dim, _ = model_kv_shape(model)[:4]
        self.layers = len(model.layers)
        self.bias = [np.array(layer.self_attn.k_proj.bias.astype(mx.float32)).reshape(self.heads, 1, self.dim)
                     for layer in model.layers]
        seen: list[list[np.ndarray]] = [[] for _ in range(self.layers)]

        def capture(layer: int, keys: Any) -> Any:
            seen[layer].append(np.array(keys.astype(mx.float32))[0])
            return keys

        token_nlls(model, calibration, None, chunk_size=CHUNK, prompt_cache=key_hooked_cache(self.layers, capture))
        half = self.dim // 2
        self.amax = []
        for layer in range(self.layers):
            centered = np.concatenate(seen[layer], axis=1) - self.bias[layer]
            peak = np.abs(centered).max(axis=1)  # [H, D]
            pair = np.maximum(peak[:, :half], peak[:, half:])  # RoPE turns channel i with i + D/2
            self.amax.append(np.concatenate([pair, pair], axis=-1).reshape(self.heads, 1, self.dim))


def schemes(stats: KeyStats, group: int) -> dict[str, KeyFn]:
    import mlx.core as mx

    from cortexstream.kv.kv_rotation import rotation_signs

    signs = mx.array(rotation_signs(stats.dim))
    scale = 1 / np.sqrt(stats.dim)

    def rounded(x: Any, size: int) -> Any:
        shape = x.shape
        packed = mx.quantize(x.reshape(-1, shape[-1]), group_size=size, bits=4)
        return mx.dequantize(*packed, group_size=size, bits=4).reshape(shape)

    def center(layer: int) -> Any:
        return mx.array(stats.bias[layer][None])

    def equalizer(layer: int) -> Any:
        return mx.array(stats.amax[layer][None])

    def per_channel(layer: int, k: Any) -> Any:
        tokens = k.shape[2]
        pad = (-tokens) % 32
        x = mx.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else k
        x = x.reshape(k.shape[0], k.shape[1], -1, 32, k.shape[3]).swapaxes(-1, -2)
        return rounded(x, 32).swapaxes(-1, -2).reshape(k.shape[0], k.shape[1], -1, k.shape[3])[:, :, :tokens]

    def blocks_of(k: Any, size: int) -> tuple[Any, int]:
        tokens = k.shape[2]
        pad = (-tokens) % size
        x = mx.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else k
        return x.reshape(k.shape[0], k.shape[1], -1, size, k.shape[3]), tokens

    def unblocked(x: Any, tokens: int) -> Any:
        return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])[:, :, :tokens]

    def minmax(x: Any, lo: Any, hi: Any) -> Any:
        """x rounded to 16 levels spanning [lo, hi] (a plain min/max quantizer: error at most half a step)."""
        step = mx.maximum((hi - lo) / 15, 1e-12)
        return mx.clip(mx.round((x - lo) / step), 0, 15) * step + lo

    def block_channel(size: int, arriving: bool) -> KeyFn:
        """One range per channel per block of `size` tokens: from the whole block (`arriving` False), or grown
        token by token as decode fills the block, every stored value of the block requantized on each growth."""
        def fn(layer: int, k: Any) -> Any:
            x, tokens = blocks_of(k.astype(mx.float32), size)
            if not arriving:
                return unblocked(minmax(x, x.min(axis=3, keepdims=True), x.max(axis=3, keepdims=True)), tokens)
            lo, hi = x[:, :, :, :1], x[:, :, :, :1]
            stored = [x[:, :, :, 0]]
            for t in range(1, size):
                row = x[:, :, :, t]
                lo, hi = mx.minimum(lo, row[:, :, :, None]), mx.maximum(hi, row[:, :, :, None])
                stored = [minmax(v, lo[:, :, :, 0], hi[:, :, :, 0]) for v in stored]
                stored.append(minmax(row, lo[:, :, :, 0], hi[:, :, :, 0]))
                mx.eval(stored)
            return unblocked(mx.stack(stored, axis=3), tokens)
        return fn

    return {
        "per_channel block16, whole block": block_channel(16, False),
        "per_channel block16, token by token": block_channel(16, True),
        f"per_token g{group}, raw": lambda i, k: rounded(k, group),
        f"per_token g{group}, centered": lambda i, k: rounded(k - center(i), group) + center(i),
        "per_token g32, centered": lambda i, k: rounded(k - center(i), 32) + center(i),
        f"per_token g{group}, centered, rotated": lambda i, k: mx.hadamard_transform(
            rounded(mx.hadamard_transform((k - center(i)) * signs, scale=scale), group), scale=scale) * signs
        + center(i),
        f"per_token g{group}, centered, equalized": lambda i, k: rounded((k - center(i)) / equalizer(i), group)
        * equalizer(i) + center(i),
        "per_channel g32 tokens": per_channel,
    }




def measure(model: Any, ids: list[int], contexts: list[int], calibration: int, group: int) -> list[dict]:
    from cortexstream.evaluation.perplexity import token_nlls
    from cortexstream.kv.prompt_cache import make_prompt_cache

    rows = []
    for context in contexts:
        stats = KeyStats(model, ids[context:context + calibration])
        cells: dict[str, Callable[[], Any]] = {"float (no rounding)": lambda: None}
        cells.update({name: (lambda fn=fn: key_hooked_cache(stats.layers, fn)) for name, fn in schemes(stats, group).items()})
        for storage in ("k=int4,v=float32,keys=token", "k=int4,v=float32,rotate=on,keys=token", "k=int4,v=float32"):
            cells[f"arena {storage}"] = lambda s=storage, c=context: make_prompt_cache(
                model, max_tokens=c, kv_dtype=s, kv_group_size=group)
        for name, build in cells.items():
            tic = time.perf_counter()
            nll = token_nlls(model, ids[:context], None, chunk_size=CHUNK, prompt_cache=build())
            rows.append({"context": context, "scheme": name, "ppl": float(np.exp(nll.mean())),
                         "seconds": time.perf_counter() - tic})
            print(f"ctx={context} {name}: ppl {rows[-1]['ppl']:.3f}", flush=True)
        base = rows[-len(cells)]["ppl"]
        for row in rows[-len(cells):]:
            row["vs_float"] = row["ppl"] / base - 1
    return rows


def report(payload: dict) -> str:
    lines = ["# 4-bit key layouts on a model with a key bias (`python -m bench.kv_key_schemes`)", "",
             f"{machine_sentence(payload['machine'])}. {payload['model'].get('source', '?')} ({payload['model'].get('architecture', '?')}); keys rounded to 4 bits, values "
             f"in float; text `{payload['text_source']}`, chunks of {CHUNK}; equalization calibrated on "
             f"{payload['calibration']} tokens after the scored ones. Accuracy only.", "",
             "| context | key scheme | perplexity | vs float |", "|---:|---|---:|---:|"]
    for r in payload["rows"]:
        lines.append(f"| {r['context']} | {r['scheme']} | {r['ppl']:.3f} | {100 * r['vs_float']:+.1f}% |")
    return "\n".join(lines + ["", f"Rerun: `{payload['command']}`", ""])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="model source (default: the verified Qwen asset)")
    parser.add_argument("--contexts", default="2048", help="comma-separated token counts to score")
    parser.add_argument("--calibration", type=int, default=1024, help="tokens of text the equalizer is measured on")
    parser.add_argument("--group", type=int, default=64, choices=(32, 64), help="channels per group (per_token)")
    parser.add_argument("--out", default="bench/results", help="output folder")


def run_from_args(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from cortexstream.benchmarks.kv_dtype import load_model
    from cortexstream.evaluation.wiki_corpus import wiki_text

    start = time.perf_counter()
    model, tokenizer, record = load_model(args.model)
    text, source = wiki_text()
    ids = list(tokenizer.encode(text))
    contexts = [int(c) for c in args.contexts.split(",")]
    if max(contexts) + args.calibration > len(ids):
        raise SystemExit(f"--contexts/--calibration: the text has {len(ids)} tokens")
    rows = measure(model, ids, contexts, args.calibration, args.group)
    payload = dict(benchmark="kv_key_schemes", machine=machine(), model=record, text_source=source,
                   calibration=args.calibration, group=args.group, rows=rows, elapsed_s=time.perf_counter() - start,
                   command=("python -m bench.kv_key_schemes " + shlex.join(sys.argv[1:])).strip())
    write_results(args.out, "kv_key_schemes", payload, report(payload))
    print(report(payload))
    return 0


def main(argv: list[str] | None = None) -> int:
    from cortexstream.backend import enable_linux_cpu_tuning

    enable_linux_cpu_tuning()
    return run_as_script(__doc__, add_arguments, run_from_args, argv, prog="python -m bench.kv_key_schemes")


if __name__ == "__main__":
    raise SystemExit(main())
