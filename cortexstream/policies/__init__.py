"""KV policies: `FullCache` (default), `StreamingLLM` (sinks + window), `H2O` (heavy hitters + recent), `SnapKV`
(the prompt's last queries vote for the keys to keep), `AdaKV` (SnapKV's votes, a layer's budget shared by its
heads), `PyramidKV` (SnapKV's votes, more keys in lower layers than in upper ones), `ExpectedAttention` (keys
scored by the attention a query drawn from the prompt's query distribution would pay them), `KVzip` (keys scored
by the attention a repetition of the context pays them: query-agnostic), `KVzipHeads` (whole contexts for the
heads a per-model profile ranks first, sinks and a window for the others: query-agnostic with no pass), and the
merging policies (`merging`: `MeanPool`, the learned `Compressor` and `Sidecar`, `TokenMerging`).

Attach one to a request with `kv_policy=` (an object or a string such as 'h2o:budget=0.2,sinks=4,recent=64');
see `base` for budgets and the policy protocol. Policies only select; the runtime that holds per-sequence state and
the SDPA hook lives in the engine (`engine.policy_runtime`, `engine.attention_hook`, `engine.policy_prompt_cache`).
"""

from cortexstream.policies.adakv import AdaKV
from cortexstream.policies.base import FullCache, KVPolicy
from cortexstream.policies.compressor import Compressor
from cortexstream.policies.d2o import D2O
from cortexstream.policies.expected_attention import ExpectedAttention
from cortexstream.policies.h2o import H2O
from cortexstream.policies.kvzip import KVzip
from cortexstream.policies.kvzip_heads import KVzipHeads
from cortexstream.policies.mean_pool import MeanPool
from cortexstream.policies.parsing import parse_policy
from cortexstream.policies.pyramidkv import PyramidKV
from cortexstream.policies.merging import Merged, MergingPolicy
from cortexstream.policies.sidecar import Sidecar
from cortexstream.policies.snapkv import SnapKV
from cortexstream.policies.streaming_llm import StreamingLLM
from cortexstream.policies.token_merging import TokenMerging

__all__ = ["AdaKV", "Compressor", "D2O", "ExpectedAttention", "FullCache", "H2O", "KVPolicy", "KVzip", "KVzipHeads",
           "MeanPool",
           "Merged", "MergingPolicy", "PyramidKV", "Sidecar", "SnapKV", "StreamingLLM", "TokenMerging",
           "parse_policy"]
