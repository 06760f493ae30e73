"""`python -m bench`: the diagnostics of this folder and how to run each."""

from __future__ import annotations

from bench import DIAGNOSTICS


def main() -> int:
    width = max(map(len, DIAGNOSTICS))
    for name, what in DIAGNOSTICS.items():
        print(f"python -m bench.{name:<{width}}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
