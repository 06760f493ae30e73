"""Experiment (README.md): `cortexstream bench retrieval` with KVzip's reconstruction replaced by token surprisal.

Arguments: those of `cortexstream bench retrieval`. Not part of the package; run from a checkout with its venv."""
import sys
from cortexstream.backend import enable_linux_cpu_tuning; enable_linux_cpu_tuning()
import numpy as np, mlx.core as mx
import cortexstream.benchmarks.retrieval_measure as rm
from cortexstream.engine.policy_prompt_cache import policy_state_of
from cortexstream.engine.reconstruction_pass import finish
from mlx_lm.models.cache import make_prompt_cache

def surprisal(model, ids, chunk=256):
    cache = make_prompt_cache(model)
    out = np.zeros(len(ids))
    out[0] = 30.0
    for s in range(0, len(ids), chunk):
        piece = mx.array(ids[s:s+chunk], dtype=mx.uint32)[None]
        logits = model(piece, cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = mx.array(ids[s+1:s+chunk+1], dtype=mx.int32)
        m = nxt.shape[0]
        got = -mx.take_along_axis(lp[:m], nxt[:, None], axis=-1)[:, 0]
        mx.eval(got)
        out[s+1:s+1+m] = np.array(got)
    return out

def fake_reconstruct(model, prompt_cache, context_ids, prompt, context, chunk=None):
    state = policy_state_of(prompt_cache)
    seq = prompt_cache[0].sequence
    ids = [int(t) for t in context_ids]
    total = seq.logical_length
    start = total - len(ids)
    s = surprisal(model, ids)
    for layer in range(len(state.scores)):
        pos = state.positions[layer]
        sc = np.full(pos.shape, 1e9)
        inside = (pos >= start) & (pos < total)
        sc[inside] = s[pos[inside] - start]
        state.scores[layer] = sc.astype(np.float64)
    return finish(seq, state, context)

rm.reconstruct = fake_reconstruct
from cortexstream.cli.main import main
sys.exit(main(["bench", "retrieval"] + sys.argv[1:]))
