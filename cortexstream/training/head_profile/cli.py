"""`cortexstream train head-profile`: measure a model's head profile for `kvzip_heads` and write it as JSON.

Text comes from tokens `--skip` on of the source (default: the gensim Wikipedia excerpt from token 65,536, held out
from every benchmark, `training.text`). The file records the model, the shape and exactly how it was measured; the
agreement between the texts (the correlation of their per-head scores) is printed.
"""

from __future__ import annotations

import argparse
import os

from cortexstream.errors import InvalidArgumentError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("head-profile", help="per-head importance (KVzip's criterion) for kvzip_heads")
    p.add_argument("--model", default=None, help="GGUF file or model directory (default: smollm2-135m)")
    p.add_argument("--name", default=None, help="model name recorded in the file (default: from --model)")
    # not `out`: `cortexstream train` prepares an `out` argument as a run folder, and this is one file
    p.add_argument("--out", dest="profile_file", required=True, help="the profile's JSON file")
    p.add_argument("--source", default="wiki", help="'wiki' (gensim Wikipedia), 'pydoc' or a text file")
    p.add_argument("--skip", type=int, default=None, help="source tokens to skip (default 65536: held out)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per calibration text")
    p.add_argument("--texts", type=int, default=4, help="calibration texts")
    p.add_argument("--chunk", type=int, default=256, help="tokens per prefill and reconstruction pass")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    for name in ("seq_len", "texts", "chunk"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')}: {getattr(args, name)} must be positive")
    import numpy as np
    from tqdm import tqdm

    from cortexstream.kv.arena_config import ArenaConfig
    from cortexstream.models.loader import load
    from cortexstream.policies.head_profile import profile_from, save_profile
    from cortexstream.training.head_profile.measure import text_scores
    from cortexstream.training.text import DEFAULT_SKIP, token_sequences

    skip = DEFAULT_SKIP if args.skip is None else args.skip
    model, tokenizer = load(args.model)
    texts, description, total = token_sequences(tokenizer, args.source, skip=skip, sequence_length=args.seq_len,
                                                count=args.texts)
    per_text = []
    for ids in tqdm(texts, desc="head profile", unit="text", disable=args.no_progress):
        per_text.append(text_scores(model, tokenizer, ids, args.chunk, 4, 64))
    scores = np.mean(per_text, axis=0)
    head_dim = ArenaConfig.for_model(model, num_tokens=16).head_dim
    name = args.name or os.path.basename(os.path.normpath(args.model or "smollm2-135m"))
    source = (f"{description}: {args.texts} texts of {args.seq_len} tokens from token {skip} (of {total}); "
              f"KVzip reconstruction in chunks of {args.chunk}; per head the mean of its keys' maxima, 4 sinks and "
              "the last 64 keys left out; averaged over the texts")
    save_profile(profile_from(name, scores, head_dim, source), args.profile_file)
    if len(per_text) > 1:
        flat = np.stack([p.reshape(-1) for p in per_text])
        agreement = np.corrcoef(flat)[np.triu_indices(len(per_text), 1)]
        print(f"agreement between texts (correlation of head scores): min {agreement.min():.4f}")
    print(f"head profile of {name}: {scores.shape[0]} layers x {scores.shape[1]} KV heads -> {args.profile_file}")
    return 0
