"""Tensor parallelism: each rank keeps 1/N of every attention and MLP projection (mlx-lm's `model.shard`) and
1/N of the vocabulary rows of the embedding table and the output head (vocab_parallel.py).

mlx-lm's llama/qwen2/mistral-style `shard(group)` splits q/k/v/gate/up by output rows and o/down by input columns,
so each rank holds `heads / N` query heads and `kv_heads / N` KV heads (its arena holds only those: the KV bytes per
rank are 1/N), and the two all-sums per layer leave every rank with the same hidden states. The split embedding
all-sums each lookup and the split head all-gathers the logits, so every rank sees the same logits. A model is
refused, before anything changes, when it has no `shard`, when a head count or the MLP width does not divide by
the number of ranks (SmolLM2-135M: 9 query heads and 3 KV heads do not split over 2 ranks), or when its embedding
table or output head cannot be split by vocabulary rows (`vocabulary_problem`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from cortexstream.distributed.errors import DistributedError
from cortexstream.distributed.vocab_parallel import split_vocabulary, vocabulary_problem
from cortexstream.models.split_mark import mark_split


def shard_problem(model: Any, size: int) -> str | None:
    """Why `model` cannot be split over `size` ranks, or None when it can."""
    kind = getattr(model, "model_type", type(model).__name__)
    if not callable(getattr(model, "shard", None)):
        return f"model type {kind!r} has no tensor-parallel split in mlx-lm (no model.shard)"
    layers = getattr(model, "layers", None) or []
    if not layers:
        return f"model type {kind!r}: no decoder layers found to split"
    attention, mlp = getattr(layers[0], "self_attn", None), getattr(layers[0], "mlp", None)
    heads = getattr(attention, "n_heads", None)
    kv_heads = getattr(attention, "n_kv_heads", None)
    if heads is None or kv_heads is None or mlp is None:
        return f"model type {kind!r}: its attention has no n_heads / n_kv_heads or no mlp to split"
    weight = getattr(getattr(mlp, "gate_proj", None), "weight", None)
    counts = [("query heads", int(heads)), ("KV heads", int(kv_heads))]
    if weight is not None:
        counts.append(("MLP width", int(weight.shape[0])))
    bad = [name for name, count in counts if count % size]
    if bad:
        have = ", ".join(f"{count} {name}" for name, count in counts)
        return (f"the model has {have}: its {' and '.join(bad)} do not divide by {size} ranks (tensor parallelism "
                f"gives each rank 1/{size} of them); run on a number of ranks that divides them")
    return vocabulary_problem(model, size)


def shard_model(model: Any, group: Any, size: int) -> None:
    """Keep this rank's 1/size of `model`'s projections (in place), or raise DistributedError saying why not."""
    problem = shard_problem(model, size)
    if problem is not None:
        raise DistributedError(f"cannot split the model over {size} ranks: {problem}")
    model.shard(group)
    split_vocabulary(model, group, size, group.rank())
    mark_split(model, size)  # a split model run by one rank alone would wait in its all-sums forever
    mx.eval(model.parameters())
