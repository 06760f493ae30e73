"""``python -m bench.arena_attention`` (from the repository root) runs the benchmark."""

from .cli import main

main()
