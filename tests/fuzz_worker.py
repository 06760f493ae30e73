"""Subprocess side of the file fuzzer: parses one file per request with the project's real readers.

Protocol (one line each way): the parent writes `<format>\t<path>\n`; the worker answers `ok`, `rejected\t<msg>`
(a CortexStreamError: the clean refusal we want) or `raw\t<type>: <msg>` (any other exception: a foreign error that
escaped). A crash (SIGSEGV, abort) ends the process, which the parent sees as EOF; a hang is the parent's timeout.
"""

from __future__ import annotations

import sys


def parse(fmt: str, path: str) -> None:
    if fmt == "gguf":
        from cortexstream.models.loader import load

        load(path)
    elif fmt == "prompt_cache":
        from cortexstream.kv.prompt_cache import load_prompt_cache

        load_prompt_cache(path)
    elif fmt in ("torch", "torch_legacy", "infinilm", "safetensors"):
        import mlx.core as mx

        from cortexstream.port import load_checkpoint

        mx.eval(list(load_checkpoint(path).tensors.values()))
    elif fmt == "selftest-crash":  # lets the harness's own test prove that a SIGSEGV is caught
        import os
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)
    elif fmt == "selftest-hang":
        import time

        time.sleep(3600)
    else:
        raise SystemExit(f"unknown format {fmt}")


def main() -> None:
    import resource

    # A fuzzed file of a few kB must never get gigabytes on its word; on this shared machine the cap turns such a
    # bug into a MemoryError (reported as "raw") instead of an out-of-memory kill of everything else.
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))
    from cortexstream.errors import CortexStreamError

    for line in sys.stdin:
        fmt, path = line.rstrip("\n").split("\t", 1)
        try:
            parse(fmt, path)
            answer = "ok"
        except CortexStreamError as exc:
            answer = "rejected\t" + " ".join(str(exc).split())[:300]
        except Exception as exc:  # noqa: BLE001 - reported to the parent as a finding
            answer = f"raw\t{type(exc).__name__}: " + " ".join(str(exc).split())[:300]
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
