"""Training and held-out examples for C2C distillation, from text disjoint from what `bench quality` evaluates.

Held-out rule (same as the sidecar's, `cortexstream.training.text`): `bench quality` scores the first ~20k tokens
of `wiki_corpus.wiki_text()`, so windows come from token `skip` on (default 65536). Training windows are
`[skip, skip + n_train * L)`, evaluation windows the stretch right after, so no evaluated window was trained on.
Tokens are counted in the receiver's tokenization; a sharer with another tokenizer gets them mapped one-to-one
(`TokenAligner`, the paper's recipe).

Computing an example costs full forwards of both models, so a set is saved once as `<name>.safetensors` (arrays
plus a JSON description of exactly what produced them) and reused only when that description matches.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import mlx.core as mx

from cortexstream.training.c2c.distill import Split, make_example, stack
from cortexstream.errors import InvalidArgumentError
from cortexstream.models.safetensors_check import check_safetensors

DEFAULT_SKIP = 65536
_META = "cortexstream.c2c.examples"


def windows(tokenizer: Any, source: str, split: Split, *, skip: int, n_train: int, n_eval: int
            ) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """(train windows, eval windows, description) of `split.length` receiver tokens each."""
    from cortexstream.training.text import token_sequences

    seqs, description, total = token_sequences(tokenizer, source, skip=skip, sequence_length=split.length,
                                               count=n_train + n_eval)
    cut = skip + n_train * split.length
    info = {"source": description, "source_tokens": total, "train_tokens": [skip, cut],
            "eval_tokens": [cut, cut + n_eval * split.length], "split": vars(split).copy()}
    return seqs[:n_train], seqs[n_train:], info


def _save(path: str, data: dict[str, Any], meta: dict[str, Any]) -> None:
    arrays = {f"src.{i}.{j}": a for i, pair in enumerate(data["src"]) for j, a in enumerate(pair)}
    arrays.update({f"tgt.{i}.{j}": a for i, pair in enumerate(data["tgt"]) for j, a in enumerate(pair)})
    arrays.update({k: data[k] for k in ("inputs", "targets", "oracle_hidden", "plain_hidden")})
    tmp = path + ".tmp.safetensors"
    mx.save_safetensors(tmp, arrays, {_META: json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)


def _load(path: str, meta: dict[str, Any]) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    check_safetensors(path)  # a damaged cache is named, not a terse MLX error
    arrays, saved = mx.load(path, return_metadata=True)
    if saved.get(_META) != json.dumps(meta, sort_keys=True):
        return None
    def pairs(prefix: str) -> list[tuple[mx.array, mx.array]]:
        n = len({k.split(".")[1] for k in arrays if k.startswith(prefix + ".")})
        return [(arrays[f"{prefix}.{i}.0"], arrays[f"{prefix}.{i}.1"]) for i in range(n)]
    return {"src": pairs("src"), "tgt": pairs("tgt"),
            **{k: arrays[k] for k in ("inputs", "targets", "oracle_hidden", "plain_hidden")}}


def example_set(path: str | None, receiver: Any, sharer: Any, seqs: Sequence[Sequence[int]], split: Split,
                meta: dict[str, Any], align: Callable[[list[int]], list[int]] | None = None,
                progress: bool = False) -> dict[str, Any]:
    """Stacked examples for `seqs` (see distill.make_example), loaded from `path` when `meta` matches."""
    if not seqs:
        raise InvalidArgumentError("example_set: no windows")
    meta = {**meta, "count": len(seqs), "split": vars(split).copy()}
    if path is not None:
        cached = _load(path, meta)
        if cached is not None:
            return cached
    from tqdm import tqdm

    examples = []
    for ids in tqdm(seqs, desc="c2c examples", unit="window", disable=not progress):
        ids = list(ids)
        examples.append(make_example(receiver, sharer, ids, align(ids) if align else ids, split))
    data = stack(examples)
    mx.eval(data)
    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _save(path, data, meta)
    return data


def take(data: dict[str, Any], index: Sequence[int] | mx.array) -> dict[str, Any]:
    """Rows `index` of a stacked example set."""
    idx = index if isinstance(index, mx.array) else mx.array(list(index), dtype=mx.int32)
    return {"src": [(k[idx], v[idx]) for k, v in data["src"]], "tgt": [(k[idx], v[idx]) for k, v in data["tgt"]],
            **{k: data[k][idx] for k in ("inputs", "targets", "oracle_hidden", "plain_hidden")}}


def size(data: dict[str, Any]) -> int:
    return int(data["inputs"].shape[0])
