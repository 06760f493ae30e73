"""Decode attention over quantized K/V on this device: which way to read 8/4-bit blocks (issue #32).

Run from a checkout: ``python -m bench.kv_quant_attention`` (about 3 minutes; ``--quick``: one shape). Writes
bench/results/kv_quant_attention.json and .md.

One attention layer's decode step at SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64), batch 1 and 8, over
512 and 4,096 keys, for K/V stored as the model's float type (float32, float16), as int8 and as int4 (groups of 64,
`mx.quantize`'s affine format, as `kv/quantized_blocks.py` stores it). Three ways to read them:

- ``float``: today's arena: `mx.fast.scaled_dot_product_attention` over float K/V (the reference).
- ``dequantize``: dequantize every K/V row of the batch into a float scratch array, then the same SDPA call.
- ``quantized_matmul``: never materialise float K/V: scores with `mx.quantized_matmul` against the packed keys
  (query heads of a KV head as rows), softmax, then `mx.quantized_matmul` against the packed values.

Variants run interleaved in a rotating order; each timing is the median of `--steps` evaluated calls. The outputs of
both quantized paths are compared with the float path over the same (unquantized) K/V, so the table also says how
much quantization moves the attention output. Measurement only: nothing in the engine changes with it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from cortexstream.benchmarks.common import write_results
from cortexstream.benchmarks.machine import machine, machine_sentence
from cortexstream.benchmarks.runner import run_as_script
from cortexstream.kv.quantized_blocks import dequantize_rows, quantize_rows

Q_HEADS, KV_HEADS, HEAD_DIM, GROUP = 9, 3, 64, 64
SCALE = HEAD_DIM ** -0.5
WAYS = ("float", "dequantize", "quantized_matmul")
DTYPES = {"float32": mx.float32, "float16": mx.float16}


def inputs(batch: int, keys: int, dtype: mx.Dtype, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((batch, Q_HEADS, 1, HEAD_DIM)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((batch, KV_HEADS, keys, HEAD_DIM)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((batch, KV_HEADS, keys, HEAD_DIM)).astype(np.float32)).astype(dtype)
    mx.eval(q, k, v)
    return q, k, v


def quantized_attention(q: mx.array, k: tuple, v: tuple, bits: int) -> mx.array:
    """Decode attention with K and V left packed: the G query heads of a KV head are the rows of one product."""
    batch, heads, _, dim = q.shape
    rows = q.reshape(batch, KV_HEADS, heads // KV_HEADS, dim) * SCALE
    scores = mx.quantized_matmul(rows, *k, transpose=True, group_size=GROUP, bits=bits)
    weights = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(q.dtype)
    out = mx.quantized_matmul(weights, *v, transpose=False, group_size=GROUP, bits=bits)
    return out.reshape(batch, heads, 1, dim)


def ways(q: mx.array, k: mx.array, v: mx.array, bits: int | None) -> dict:
    """name -> callable returning the attention output, for one stored form of K/V."""
    if bits is None:
        return {"float": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)}
    batch, heads, keys, dim = k.shape

    def packed(x: mx.array) -> tuple:  # the codec stores [1, H, S, D]: the batch's heads side by side
        return tuple(a.reshape(batch, heads, keys, -1) for a in quantize_rows(x.reshape(1, -1, keys, dim), bits, GROUP))

    def floats(p: tuple) -> mx.array:
        flat = tuple(a.reshape(1, batch * heads, keys, -1) for a in p)
        return dequantize_rows(*flat, bits, GROUP, q.dtype).reshape(batch, heads, keys, dim)

    qk, qv = packed(k), packed(v)
    mx.eval(qk, qv)
    return {
        "dequantize": lambda: mx.fast.scaled_dot_product_attention(q, floats(qk), floats(qv), scale=SCALE),
        "quantized_matmul": lambda: quantized_attention(q, qk, qv, bits),
    }


def time_calls(calls: dict, warmup: int, steps: int) -> dict[str, float]:
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            mx.eval(calls[name]())
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps):
        for name in names[step % len(names):] + names[: step % len(names)]:  # rotating order
            tic = time.perf_counter()
            mx.eval(calls[name]())
            times[name].append(time.perf_counter() - tic)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def measure(batch: int, keys: int, dtype_name: str, warmup: int, steps: int) -> list[dict]:
    q, k, v = inputs(batch, keys, DTYPES[dtype_name])
    reference = ways(q, k, v, None)
    calls = {("float", "float"): reference["float"]}
    for bits in (8, 4):
        for way, call in ways(q, k, v, bits).items():
            calls[(f"int{bits}", way)] = call
    ms = time_calls(calls, warmup, steps)
    exact = np.array(reference["float"]().astype(mx.float32))
    rows = []
    for (storage, way), call in calls.items():
        error = float(np.abs(np.array(call().astype(mx.float32)) - exact).max())
        rows.append(dict(batch=batch, keys=keys, dtype=dtype_name, storage=storage, way=way, ms=ms[(storage, way)],
                         max_abs_error=error, vs_float=ms[(storage, way)] / ms[("float", "float")]))
    return rows


def report(payload: dict) -> str:
    lines = [
        "# Decode attention over quantized K/V (`python -m bench.kv_quant_attention`)", "",
        f"{machine_sentence(payload['machine'])}. One layer's decode step at SmolLM2's shapes ({Q_HEADS} query heads, "
        f"{KV_HEADS} KV heads, head dim {HEAD_DIM}); int8/int4 in groups of {GROUP}; median of {payload['steps']} "
        "calls, variants interleaved. Error: largest absolute difference of the attention output from the float "
        "path over the unquantized K/V.", "",
        "| batch | keys | model dtype | K/V stored | read by | ms per layer | vs float | max abs error |",
        "|---:|---:|---|---|---|---:|---:|---:|",
    ]
    for r in payload["rows"]:
        lines.append(f"| {r['batch']} | {r['keys']} | {r['dtype']} | {r['storage']} | {r['way']} | {r['ms']:.3f} | "
                     f"{r['vs_float']:.2f}x | {r['max_abs_error']:.2e} |")
    best = {}
    for r in payload["rows"]:
        if r["storage"] != "float":
            key = (r["batch"], r["keys"], r["dtype"], r["storage"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    faster = {way: sum(1 for r in best.values() if r["way"] == way) for way in ("dequantize", "quantized_matmul")}
    lines += ["", f"Faster way per quantized cell: quantized_matmul in {faster['quantized_matmul']} of {len(best)}, "
              f"dequantize in {faster['dequantize']}.", ""]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one shape (batch 8, 4,096 keys, float32)")
    parser.add_argument("--steps", type=int, default=30, help="timed calls per variant")
    parser.add_argument("--out", default="bench/results", help="output folder")


def run_from_args(args: argparse.Namespace) -> int:
    shapes = [(8, 4096, "float32")] if args.quick else [
        (b, n, d) for d in DTYPES for b in (1, 8) for n in (512, 4096)]
    start = time.perf_counter()
    rows = []
    for batch, keys, dtype_name in shapes:
        rows += measure(batch, keys, dtype_name, warmup=3, steps=args.steps)
        print(f"batch {batch}, {keys} keys, {dtype_name}: done", flush=True)
    payload = dict(benchmark="kv_quant_attention", machine=machine(), steps=args.steps, group_size=GROUP,
                   elapsed_s=time.perf_counter() - start, rows=rows)
    name = "kv_quant_attention_quick" if args.quick else "kv_quant_attention"
    write_results(args.out, name, payload, report(payload))
    print(report(payload))
    return 0


def main(argv: list[str] | None = None) -> int:
    from cortexstream.backend import enable_linux_cpu_tuning

    enable_linux_cpu_tuning()  # OpenBLAS and the JIT flags, as the cortexstream command runs (docs/linux-cpu.md)
    return run_as_script(__doc__, add_arguments, run_from_args, argv, prog="python -m bench.kv_quant_attention")


if __name__ == "__main__":
    raise SystemExit(main())
