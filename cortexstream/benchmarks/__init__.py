"""Benchmarks behind `cortexstream bench ...`; results are written as JSON + Markdown under bench/results/."""
