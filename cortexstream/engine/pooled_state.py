"""The pooled-cells side of a sequence's `PolicyState` (policies that `pools_heads`, and `pools_layers`): compressing
to the cells a policy chose with each column's own first and the surplus lent (`keep_cells`), and attending a
layer whose cells have owners, its keys held in other layers' cells included (`attend_pooled`). The layouts are
`engine.pooled_heads` and `engine.pooled_layers`; the state they read and write (scores, positions, bias, owners,
owner_layers, foreign, the bound sequence) is `PolicyState`'s, set up in its constructor.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from cortexstream.engine.pooled_decode import ExtrasReader, attend_columns, layer_cells
from cortexstream.engine.pooled_heads import (
    FLAT_QUERIES, Foreign, Reduce, attend_cells, column_owners, gather_cells, is_pooled, place,
)
from cortexstream.engine.pooled_layers import foreign_cells, read_foreign
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.sequence_kv import SequenceKV


class PooledCells:
    """Mixed into `PolicyState` (which owns every attribute used here)."""

    def keep_cells(self, seq: SequenceKV, keep: np.ndarray | None) -> int:
        """Keep the cells `keep` (bool `[L, H, n]`, as `select_cells` gives) in `budget` slots: each column its
        own kept cells first, the surplus of heads that keep more in the cells others leave (`pooled_heads.place`;
        with `pools_layers` the columns of every layer lend to each other, `engine.pooled_layers`). Returns the
        physical slots removed."""
        if keep is None:
            return 0
        n = seq.num_tokens
        layers, heads = len(self.scores), self.scores[0].shape[0]
        if keep.shape != (layers, heads, n) or keep.dtype != np.bool_:
            raise InvalidArgumentError(f"{self.policy.name}: select_cells gave {keep.shape} {keep.dtype}, expected "
                                       f"a bool mask {(layers, heads, n)}")
        if self.policy.pools_layers:  # sources index the cells of all layers, flattened (layer, column, slot)
            sources = place(keep.reshape(layers * heads, n)).reshape(layers, heads, -1)
        else:
            sources = [place(layer_keep) + layer * heads * n for layer, layer_keep in enumerate(keep)]
            if any(src.shape[1] != sources[0].shape[1] for src in sources):
                raise InvalidArgumentError(f"{self.policy.name}: every layer must keep as many cells")
            sources = np.stack(sources)
        m = sources.shape[2]
        if (self.mass != 1).any():
            raise InvalidArgumentError(f"{self.policy.name}: pooled heads cannot hold merged slots")
        columns = np.arange(layers * heads).reshape(layers, heads, 1)
        if (sources // n == columns).all():  # no cell changes column: exact moves, as a per-head selection makes them
            seq.keep(sources % n)
        else:
            new_keys, new_values = [], []
            if self.policy.pools_layers:  # cells move between layers: every layer's K/V, read once
                reads = [seq.arena.read(layer, seq.blocks, n) for layer in range(layers)]
                all_keys = mx.concatenate([k.reshape(heads * n, -1) for k, _ in reads])
                all_values = mx.concatenate([v.reshape(heads * n, -1) for _, v in reads])
            for layer, src in enumerate(sources):
                if self.policy.pools_layers:
                    flat_keys, flat_values, index = all_keys, all_values, src
                else:  # one layer at a time: its cells stay in it
                    keys, values = seq.arena.read(layer, seq.blocks, n)
                    flat_keys, flat_values = keys.reshape(heads * n, -1), values.reshape(heads * n, -1)
                    index = src - layer * heads * n
                index = mx.array(index.reshape(-1).astype(np.int32))
                new_keys.append(flat_keys[index].reshape(heads, m, -1))
                new_values.append(flat_values[index].reshape(heads, m, -1))
            mx.eval(new_keys, new_values)  # before any layer is rewritten: a layer's cells may come from another
            seq.replace(0, n, new_keys, new_values, evicts=True)
        flat = sources.reshape(layers * heads, m)
        for name in ("scores", "positions", "bias", "owners", "owner_layers"):
            rows = np.stack(getattr(self, name)).reshape(layers * heads, n)
            setattr(self, name, list(gather_cells(rows, flat).reshape(layers, heads, m)))
        self.foreign = foreign_cells(self.owners, self.owner_layers) if self.policy.pools_layers \
            else [None] * layers
        self.pooled = [is_pooled(self.owners[layer]) or bool((self.owner_layers[layer] != layer).any())
                       or self.foreign[layer] is not None for layer in range(layers)]
        self.mass = np.ones(m)
        self._bias_arrays.clear()
        self._layer_cells.clear()
        self.num_evicted += n - m
        self.num_evictions += 1
        return n - m

    def is_pooled(self, layer: int) -> bool:
        return self.pooled[layer]

    def any_pooled(self) -> bool:
        return any(self.pooled)

    def owners_for(self, layer: int, num_keys: int) -> np.ndarray:
        """Owners `[H, num_keys]`: the stored cells', then each column's own for this pass's new tokens."""
        owners = self.owners[layer][:, :num_keys]
        extra = num_keys - owners.shape[1]
        if extra <= 0:
            return owners
        tail = column_owners(owners.shape[0], num_keys)[:, owners.shape[1]:]
        return np.concatenate([owners, tail], axis=1)

    def mine(self, layer: int, num_keys: int) -> np.ndarray | None:
        """Bool `[H, num_keys]`: the cells of this layer's arrays that hold this layer's keys (None: every one)."""
        stored = self.owner_layers[layer][:, :num_keys] == layer
        if stored.all():
            return None
        return np.concatenate([stored, np.ones((stored.shape[0], num_keys - stored.shape[1]), bool)], axis=1)

    def foreign_for(self, layer: int) -> Foreign | None:
        """This layer's keys held in other layers' cells, read from the arena as it is now (None: none)."""
        cells = self.foreign[layer]
        if cells is None:
            return None
        if self.sequence is None:
            raise InvalidArgumentError(f"{self.policy.name}: cells lent across layers need the sequence (bind)")
        keys, values = read_foreign(self.sequence, cells)
        bias = np.stack([self.bias[int(m)][c, s] for m, c, s in zip(cells.lenders, cells.columns, cells.slots)]) \
            if self.has_bias() else None
        return Foreign(keys, values, cells.heads, bias)

    def attend_pooled(self, layer: int, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: Any, sinks: mx.array | None, record_from: int | None, valid: int | None = None
                      ) -> mx.array:
        """One sequence's attention over a layer whose cells have owners, its logit biases added and, from query
        row `record_from` on (None: not at all), its scores recorded: short passes per column
        (`pooled_decode.attend_columns`), longer ones and models with sinks per owner (`pooled_heads.attend_cells`)."""
        num_keys = keys.shape[2]
        if self.reconstruction is not None:  # KVzip: maxima during a reconstruction pass only, never sums
            owners, bias = self.owners_for(layer, num_keys), self.bias_row(layer, num_keys)
            if self.foreign[layer] is not None or self.mine(layer, num_keys) is not None:
                raise InvalidArgumentError(f"{self.policy.name}: a reconstruction over cells lent across layers "
                                           "is not supported")
            if not self.reconstruction.recording:
                return attend_cells(queries, keys, values, scale, mask, sinks, owners, bias, valid)[0]
            out, received, _ = attend_cells(queries, keys, values, scale, mask, sinks, owners, bias, valid, 0,
                                            Reduce.MAX)
            self.reconstruction.add(layer, received)
            return out
        if not self.policy.needs_attention_scores:
            record_from = None
        if sinks is None and queries.shape[2] <= FLAT_QUERIES:
            reader = self._cells_reader(layer)
            extra_keys, extra_values = reader.read(self._bound()) if reader.cells.groups else (None, None)
            out, received, far = attend_columns(reader.cells, queries, keys, values, scale, mask, valid, extra_keys,
                                                extra_values, record_from)
        else:
            owners, bias = self.owners_for(layer, num_keys), self.bias_row(layer, num_keys)
            out, received, far = attend_cells(queries, keys, values, scale, mask, sinks, owners, bias, valid,
                                              record_from, mine=self.mine(layer, num_keys),
                                              foreign=self.foreign_for(layer))
        if received is not None:
            self.record(layer, received)
        if far is not None:
            prior = self.pending_foreign[layer]
            self.pending_foreign[layer] = far if prior is None else prior + far
        return out

    def _cells_reader(self, layer: int) -> ExtrasReader:
        """The layer's cells as laid out since the last compaction (built at its first short pass)."""
        reader = self._layer_cells.get(layer)
        if reader is None:
            bias = self.bias[layer] if self.bias[layer].any() else None
            cells = self.foreign[layer]
            far_bias = None
            if cells is not None and self.has_bias():
                far_bias = np.array([self.bias[int(m)][c, s] for m, c, s in
                                     zip(cells.lenders, cells.columns, cells.slots)], np.float32)
            reader = ExtrasReader(layer_cells(layer, self.owners[layer], self.owner_layers[layer], bias, cells,
                                              far_bias))
            self._layer_cells[layer] = reader
        return reader

    def _bound(self) -> SequenceKV:
        if self.sequence is None:
            raise InvalidArgumentError(f"{self.policy.name}: cells lent between heads and layers are read through "
                                       "the sequence (bind)")
        return self.sequence


__all__ = ["PooledCells"]
