"""Diagnostic: real KVzip scores vs proxies on a later-turn trial: overlap of kept sets, needle coverage."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cortexstream.backend import enable_linux_cpu_tuning; enable_linux_cpu_tuning()
import numpy as np
import cortexstream.benchmarks.retrieval_measure as rm
from cortexstream.engine.policy_prompt_cache import policy_state_of
from cortexstream.engine.reconstruction_pass import finish, score_pass
from cortexstream.policies.snapkv import pool_scores, Pooling
import lookahead as LA
from cortexstream.benchmarks.speculative_models import load_model
_, TOK, _ = load_model("smollm2-135m")
LOG = open("diag.log", "a")

def proxies(model, ids):
    out = {}
    for v in os.environ.get("VARIANTS", "full,ahead,next,next_causal").split(","):
        LA.VARIANT = v
        out[v] = LA.scores_of(model, ids)
    return out

def kept(s, frac=0.33, kernel=15):
    p = pool_scores(s, kernel, Pooling.MAX)
    k = int(frac * s.shape[-1])
    idx = np.argsort(-p, axis=-1)[..., :k]
    m = np.zeros(s.shape, bool); np.put_along_axis(m, idx, True, axis=-1); return m

def fake(model, prompt_cache, context_ids, prompt, context, chunk=None):
    state = policy_state_of(prompt_cache); seq = prompt_cache[0].sequence
    ids = [int(t) for t in context_ids]
    total = seq.logical_length; start = total - len(ids)
    for s0 in range(0, len(ids), state.policy.chunk):
        score_pass(model, seq, state, prompt.chunk_tokens(ids[s0:s0+state.policy.chunk]))
    real = [sc[:, (state.positions[l][0] >= start)].copy() for l, sc in enumerate(state.scores)]
    px = proxies(model, ids)
    # needle tokens: find the digits
    pieces = [TOK.decode([t]) for t in ids]
    text = "".join(pieces); starts = np.cumsum([0] + [len(p) for p in pieces])
    spans = []
    import re
    for m in re.finditer(r"\d{5,6}", text):
        a = np.searchsorted(starts, m.start(), side="right") - 1; b = np.searchsorted(starts, m.end() - 1, side="right") - 1
        spans.append((m.group(0), a, b))
    print("codes in doc:", spans, file=LOG, flush=True)

    rk = [kept(r) for r in real]
    for name, sl in [("kvzip", real)] + list(px.items()):
        ks = [kept(s) for s in sl]
        ov = np.mean([(a & b).sum() / b.sum() for a, b in zip(ks, rk)])
        cov = {c: np.mean([k[:, a:b+1].all(axis=1).mean() for k in ks]) for c, a, b in spans}
        print(f"{name:12s} overlap-with-kvzip {ov:.3f} needle-kept-frac {cov}", file=LOG, flush=True)
    return finish(seq, state, context)

rm.reconstruct = fake
from cortexstream.cli.main import main
sys.exit(main(["bench", "retrieval"] + sys.argv[1:]))
