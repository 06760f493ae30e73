"""A quick sidecar-vs-baselines comparison: perplexity at one context and needle retrieval, with the physical
cache size each policy really used. The full frontier (several contexts, passkey) is `cortexstream bench quality`.

    python -m cortexstream.training.sidecar.compare --tokens 2048 --out sidecar_compare.json \\
        --policies full sidecar:window=16 h2o:budget=207,sinks=4 ...

Perplexity is scored on the first `tokens` tokens of `wiki_corpus.wiki_text()` (the same text as `bench
quality`; the sidecar never trained on it, see `sidecar.data`), teacher-forced in chunks of `chunk` with the
policy applied after each chunk. `mean_physical` is the mean over chunks of the cache's physical size after the
policy ran; `final_physical` the size after the last chunk. Results are written after every row.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Sequence

import numpy as np

from cortexstream.atomic_files import write_json_atomic


def perplexity_row(model: Any, ids: Sequence[int], spec: str, chunk: int) -> dict[str, Any]:
    from cortexstream.evaluation.perplexity import token_nlls

    sizes: list[int] = []

    def record(_: int, cache: list[Any]) -> None:
        seq = getattr(cache[0], "sequence", None)
        sizes.append(int(seq.num_tokens) if seq is not None else int(cache[0].offset))

    tic = time.perf_counter()
    nll = token_nlls(model, list(ids), None if spec == "full" else spec, chunk_size=chunk, on_chunk=record)
    return {"policy": spec, "tokens": len(ids), "chunk": chunk, "perplexity": round(float(np.exp(nll.mean())), 4),
            "mean_physical": round(float(np.mean(sizes)), 1), "final_physical": sizes[-1],
            "seconds": round(time.perf_counter() - tic, 1)}


def compare(model: Any, tokenizer: Any, policies: list[str], *, tokens: int = 2048, chunk: int = 16,
            needle_context: int = 0, needle_trials: int = 5, out: str | None = None,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    from cortexstream.evaluation.needle import run_needle
    from cortexstream.evaluation.wiki_corpus import wiki_text
    from cortexstream.policies import parse_policy

    for spec in policies:
        parse_policy(spec)
    text, source = wiki_text()
    ids = list(tokenizer.encode(text))[:tokens]
    result: dict[str, Any] = {"text": source, "tokens": tokens, "chunk": chunk, "perplexity": [], "needle": []}

    def save() -> None:
        if out:
            write_json_atomic(out, result, indent=1)

    for spec in policies:
        row = perplexity_row(model, ids, spec, chunk)
        result["perplexity"].append(row)
        log(f"{spec:45s} ppl {row['perplexity']:8.3f}  physical mean {row['mean_physical']:7.1f} final "
            f"{row['final_physical']:5d}  ({row['seconds']:.0f} s)")
        save()
    if needle_context:
        for spec in policies:
            result["needle"] += run_needle(model, tokenizer, [spec], contexts=(needle_context,),
                                           trials=needle_trials, log=log)
            save()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", required=True, help="policy strings ('full' for no policy)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--needle-context", type=int, default=0, help="0: skip the needle part")
    parser.add_argument("--needle-trials", type=int, default=5)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=None, help="JSON file, rewritten after every row")
    args = parser.parse_args(argv)
    from cortexstream.models.loader import load

    model, tokenizer = load(args.model)
    compare(model, tokenizer, args.policies, tokens=args.tokens, chunk=args.chunk,
            needle_context=args.needle_context, needle_trials=args.needle_trials, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
