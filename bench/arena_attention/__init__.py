"""The KV-arena attention benchmark, one concept per module (what it measures: `__main__.py`).

common: shapes, constants and the timing primitives; cases: the measured variants of experiment 1;
attention: experiments 1, 5 and 6 (decode-step attention through the caches); layout: experiments 2-4 (layout and
one-buffer design checks); meta: the machine record; report: Markdown and conclusions; cli: argument parsing and the
run. Run it with ``python -m bench.arena_attention`` (results in bench/results/ by default).
"""
