"""The KV-arena attention benchmark, one concept per module (what it measures: bench/bench_arena_attention.py).

common: shapes, constants and the timing primitives; cases: the measured variants of experiment 1;
attention: experiments 1, 5 and 6 (decode-step attention through the caches); layout: experiments 2-4 (layout and
one-buffer design checks); meta: the machine record; report: Markdown and conclusions; cli: argument parsing and the
run. Run it with ``python bench/bench_arena_attention.py`` (or ``python -m bench.arena_attention``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's cortexstream, before any submodule imports it
