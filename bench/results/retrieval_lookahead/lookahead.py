"""Experiment: KVzip's reconstruction replaced by the context's own queries attending non-causally.
VARIANT env: full (softmax over all keys, max over all queries), ahead (max over queries before the key),
next (query j-1's attention to key j, full softmax), next_causal (query j-1 over keys 0..j)."""
import os, sys
from cortexstream.backend import enable_linux_cpu_tuning; enable_linux_cpu_tuning()
import numpy as np, mlx.core as mx
import cortexstream.benchmarks.retrieval_measure as rm
from cortexstream.engine.policy_prompt_cache import policy_state_of
from cortexstream.engine.reconstruction_pass import finish
from mlx_lm.models.cache import make_prompt_cache

VARIANT = os.environ.get("VARIANT", "full")

class Rec:
    def __init__(self, attn):
        self.attn = attn; self.q = []; self.k = []
    def __call__(self, x, mask=None, cache=None):
        a = self.attn; B, L, _ = x.shape
        q = a.q_proj(x).reshape(B, L, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = a.rope(q, offset=cache.offset); k = a.rope(k, offset=cache.offset)
        self.q.append(q[0]); self.k.append(k[0])
        return a(x, mask=mask, cache=cache)

def scores_of(model, ids, chunk=256):
    layers = model.model.layers if hasattr(model, "model") else model.layers
    recs = []
    for layer in layers:
        r = Rec(layer.self_attn); recs.append(r); layer.self_attn = r
    try:
        cache = make_prompt_cache(model)
        for s in range(0, len(ids), chunk):
            out = model(mx.array(ids[s:s+chunk], dtype=mx.uint32)[None], cache=cache)
            mx.eval(out, [r.q[-1] for r in recs], [r.k[-1] for r in recs])
    finally:
        for layer, r in zip(layers, recs):
            layer.self_attn = r.attn
    out = []
    n = len(ids)
    for r in recs:
        Q = mx.concatenate(r.q, axis=1); K = mx.concatenate(r.k, axis=1)  # (H,N,D), (KVH,N,D)
        H, KVH = Q.shape[0], K.shape[0]; g = H // KVH
        scale = r.attn.scale
        per_kv = []
        for kv in range(KVH):
            best = None
            for h in range(kv * g, (kv + 1) * g):
                s = (Q[h] @ K[kv].T) * scale  # (N, N): query i, key j
                idx = mx.arange(n)
                if VARIANT == "next_causal":
                    s = mx.where(idx[None, :] <= idx[:, None] + 1, s, -mx.inf)
                p = mx.softmax(s.astype(mx.float32), axis=-1)
                if VARIANT in ("full",):
                    sc = p.max(axis=0)
                elif VARIANT == "ahead":
                    sc = mx.where(idx[None, :] > idx[:, None], p, 0).max(axis=0)
                else:  # next, next_causal: key j from query j-1
                    d = mx.concatenate([mx.array([1.0]), p[idx[:-1], idx[1:]]])
                    sc = d
                best = sc if best is None else mx.maximum(best, sc)
            per_kv.append(best)
        arr = mx.stack(per_kv); mx.eval(arr)
        out.append(np.array(arr))
    return out  # per layer (KVH, N)

def fake_reconstruct(model, prompt_cache, context_ids, prompt, context, chunk=None):
    state = policy_state_of(prompt_cache)
    seq = prompt_cache[0].sequence
    ids = [int(t) for t in context_ids]
    total = seq.logical_length
    start = total - len(ids)
    sc_layers = scores_of(model, ids)
    for layer in range(len(state.scores)):
        pos = state.positions[layer]
        sc = np.full(pos.shape, 1e9)
        inside = (pos >= start) & (pos < total)
        s = sc_layers[layer]
        if pos.ndim == 2:
            for h in range(pos.shape[0]):
                sc[h][inside[h]] = s[h % s.shape[0]][pos[h][inside[h]] - start]
        else:
            sc[inside] = s.max(axis=0)[pos[inside] - start]
        state.scores[layer] = sc.astype(np.float64)
    return finish(seq, state, context)

if __name__ == "__main__":
    rm.reconstruct = fake_reconstruct
    from cortexstream.cli.main import main
    sys.exit(main(["bench", "retrieval"] + sys.argv[1:]))
