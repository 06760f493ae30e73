"""Arena blocks exported as bytes and imported into other blocks come back bit-identical (kv/block_io.py)."""

import mlx.core as mx
import numpy as np

from cortexstream.kv.arena_sides import side_slots
import pytest

from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.block_io import BlockExport, block_bytes, import_blocks
from cortexstream.kv.kv_dtype import parse_kv_dtype


def _arena(dtype: str, kv_dtype: str | None) -> KVArena:
    kv = parse_kv_dtype(kv_dtype, 32, model_dtype=dtype) if kv_dtype else None
    config = ArenaConfig(num_layers=3, num_kv_heads=2, head_dim=64, num_blocks=12, block_size=4, dtype=dtype,
                         kv_dtype=kv)
    return KVArena(config, preallocate=True)


def _fill(arena: KVArena, seed: int) -> None:
    rng = np.random.default_rng(seed)
    slots = arena.config.num_slots
    for layer in range(arena.config.num_layers):
        k = mx.array(rng.standard_normal((1, 2, slots, 64)).astype(np.float32)).astype(arena.dtype)
        v = mx.array(rng.standard_normal((1, 2, slots, 64)).astype(np.float32)).astype(arena.dtype)
        arena.write_slots(layer, slice(0, slots), k, v)
    mx.eval(arena.arrays())


def _block_rows(arena: KVArena, block: int) -> list[np.ndarray]:
    bs = arena.config.block_size
    out = []
    for layer in range(arena.config.num_layers):
        for side in (arena.keys[layer], arena.values[layer]):
            arrays = side.arrays() if hasattr(side, "arrays") else [side]
            for a in arrays:  # keys grouped per channel keep one row of scales per block
                rows = bs if a.shape[2] == side_slots(side) else 1
                out.append(np.array(a[:, :, block * rows:(block + 1) * rows, :].view(mx.uint8)))
    return out


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", None), ("float16", None), ("bfloat16", None),
                                            ("float16", "int8"), ("float16", "k=int8,v=int4"),
                                            ("bfloat16", "int4")])
def test_round_trip_is_bit_identical(dtype, kv_dtype):
    source, target = _arena(dtype, kv_dtype), _arena(dtype, kv_dtype)
    _fill(source, 0)
    _fill(target, 1)
    blocks = [7, 2, 9]
    payloads = BlockExport(source, blocks).payloads()
    assert [len(p) for p in payloads] == [block_bytes(source)] * 3
    destination = [0, 5, 11]
    before = _block_rows(target, 3)  # a block not written stays as it was
    import_blocks(target, destination, payloads)
    for src, dst in zip(blocks, destination):
        for a, b in zip(_block_rows(source, src), _block_rows(target, dst)):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(before, _block_rows(target, 3)):
        np.testing.assert_array_equal(a, b)


def test_wrong_payload_size_is_refused():
    arena = _arena("float32", None)
    payload = BlockExport(arena, [1]).payloads()[0]
    with pytest.raises(ValueError, match="bytes"):
        import_blocks(arena, [2], [payload[:-4]])
    with pytest.raises(ValueError, match="payloads"):
        import_blocks(arena, [2, 3], [payload])
    assert BlockExport(arena, []).payloads() == []
