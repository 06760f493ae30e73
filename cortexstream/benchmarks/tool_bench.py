"""`cortexstream bench tools`: tool calls and enforced JSON schemas over HTTP, CortexStream beside the peers.

Every server is started as a subprocess on the same mlx-lm directory (the Qwen2.5-Coder-0.5B-Instruct benchmark
asset by default, converted once; `--model-dir` reuses a converted one), one at a time on 127.0.0.1, and asked the
same requests with the `openai` SDK:
- the tool cases (`tool_cases`) with `tool_choice` "auto" (the server parses the text) and "required" (the server
  should enforce a call), greedy, `parallel_tool_calls=false`;
- the first `--schemas` schema cases of `bench structured` with `response_format` json_schema (strict).
Systems: `cortexstream` and `mlx_lm` (this interpreter) and each peer given with `--peer-python NAME=PYTHON`
(vllm-mlx and rapid-mlx are started with `--enable-auto-tool-choice --tool-call-parser <--tool-parser>`). An HTTP
error or a server that does not start is recorded as what that server did, not a failed benchmark.
Writes `<out>/tools.json` and `tools.md`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cortexstream.benchmarks.common import show_report, write_report
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.benchmarks.serve_processes import Launch, Peer, start_server
from cortexstream.errors import InvalidArgumentError

NAME = "tools"
PARTS = ("tools", "schemas", "servers", "runs")
OWN_SYSTEMS = ("cortexstream", "mlx_lm")


@dataclass(frozen=True)
class ToolBenchSettings:
    """`model`: a source for `cortexstream convert` (None: the Qwen2.5-Coder-0.5B asset); `model_dir`: an mlx-lm
    directory to use as it is instead; `peers`: peer -> its venv's python; `workers`: requests in flight."""

    model: str | None = None
    model_dir: str | None = None
    systems: tuple[str, ...] = OWN_SYSTEMS
    peers: dict[Peer, str] = field(default_factory=dict)
    variants: tuple[tuple[Peer, str, str], ...] = ()  # (peer, variable, value): one more run of a given peer
    tool_parser: str = "hermes"
    workers: int = 4
    max_tokens: int = 192
    schemas: int = 12
    schema_max_tokens: int = 256
    kv_tokens: int = 16384
    timeout: float = 600.0

    def __post_init__(self) -> None:
        for system in self.systems:
            if system not in OWN_SYSTEMS:
                raise InvalidArgumentError(f"--systems: {system!r} must be among {', '.join(OWN_SYSTEMS)} (peers "
                                           "come with --peer-python)")
        if not self.systems and not self.peers:
            raise InvalidArgumentError("--systems: no server to measure (give a system or a --peer-python)")
        for name in ("workers", "max_tokens", "schema_max_tokens", "kv_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"--{name.replace('_', '-')}: {value!r} must be an integer >= 1")
        if self.schemas:
            from cortexstream.benchmarks.structured_schemas import schema_cases

            schema_cases(self.schemas)  # the range check, naming --schemas
        if self.model_dir is not None and not (Path(self.model_dir) / "config.json").is_file():
            raise InvalidArgumentError(f"--model-dir: {self.model_dir} has no config.json (not an mlx-lm directory)")
        if not self.timeout > 0:
            raise InvalidArgumentError(f"--timeout: {self.timeout!r} must be > 0")
        for peer, _, _ in self.variants:
            if peer not in self.peers:
                raise InvalidArgumentError(f"--peer-variant: {peer} has no --peer-python")

    def launches(self) -> list[Launch]:
        out = [Launch(s, self.kv_tokens if s == "cortexstream" else None, self.workers) for s in self.systems]
        tool_peers = (Peer.VLLM_MLX, Peer.RAPID_MLX)
        runs = [(peer, ()) for peer in self.peers] + [(peer, ((key, value),)) for peer, key, value in self.variants]
        return out + [Launch(peer.value, None, self.workers, python=self.peers[peer], env=env, fresh_home=True,
                             tool_parser=self.tool_parser if peer in tool_peers else None) for peer, env in runs]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ToolBenchSettings()
    parser.add_argument("--model", default=None, help="model to convert and serve (default: the "
                        "Qwen2.5-Coder-0.5B-Instruct benchmark asset)")
    parser.add_argument("--model-dir", default=None, help="an mlx-lm directory to serve as it is (no conversion)")
    parser.add_argument("--systems", default=",".join(d.systems), help="comma-separated: cortexstream, mlx_lm")
    parser.add_argument("--peer-python", action="append", default=None, metavar="NAME=PYTHON",
                        help="a peer server from its own venv (repeatable): vllm_mlx, rapid_mlx, mlx_vlm")
    parser.add_argument("--peer-variant", action="append", default=None, metavar="NAME:VAR=VALUE",
                        help="one more run of a peer with an environment variable set (repeatable), e.g. "
                             "rapid_mlx:RAPID_MLX_CONSTRAIN_TOOLS=0")
    parser.add_argument("--tool-parser", default=d.tool_parser, help="tool-call parser vllm-mlx/rapid-mlx start with")
    parser.add_argument("--workers", type=int, default=d.workers, help="requests in flight per server")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens of a tool request")
    parser.add_argument("--schemas", type=int, default=d.schemas, help="json_schema requests (0: none)")
    parser.add_argument("--schema-max-tokens", type=int, default=d.schema_max_tokens)
    parser.add_argument("--timeout", type=float, default=d.timeout, help="seconds per request")
    parser.add_argument("--out", default="bench/results", help="output folder")


def from_args(args: argparse.Namespace) -> ToolBenchSettings:
    from cortexstream.benchmarks.serve_memory_options import parse_peer_pythons
    from cortexstream.cli.number_lists import name_list

    systems = name_list(args.systems)
    return ToolBenchSettings(model=args.model, model_dir=args.model_dir, systems=systems,
                             peers=parse_peer_pythons(args.peer_python),
                             variants=parse_variants(args.peer_variant), tool_parser=args.tool_parser,
                             workers=args.workers, max_tokens=args.max_tokens, schemas=args.schemas,
                             schema_max_tokens=args.schema_max_tokens, timeout=args.timeout)


def parse_variants(items: list[str] | None) -> tuple[tuple[Peer, str, str], ...]:
    out = []
    for item in items or []:
        name, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not sep or not eq or not key.strip():
            raise InvalidArgumentError(f"--peer-variant: {item!r} must be NAME:VARIABLE=VALUE")
        try:
            peer = Peer(name.strip().replace("-", "_"))
        except ValueError:
            raise InvalidArgumentError(f"--peer-variant: {name!r} is not a peer; choose from "
                                       f"{', '.join(p.value for p in Peer)}") from None
        out.append((peer, key.strip(), value))
    return tuple(out)


def _model_dir(s: ToolBenchSettings, work: Path) -> str:
    if s.model_dir is not None:
        return s.model_dir
    from cortexstream.benchmarks.serve import convert_to_mlx_lm

    source = s.model
    if source is None:
        from cortexstream.training.c2c.sharer_asset import qwen_coder_gguf

        source = qwen_coder_gguf()  # an AssetError saying how to fetch it when absent
    print(f"[bench tools] converting {os.path.basename(source)} to an mlx-lm directory", flush=True)
    convert_to_mlx_lm(source, work / "model")
    return str(work / "model")


def measure_server(launch: Launch, model_dir: str, work: Path, s: ToolBenchSettings, results: ResultStore,
                   log: Callable[[str], None], progress: bool) -> None:
    from cortexstream.benchmarks.structured_schemas import schema_cases
    from cortexstream.benchmarks.tool_bench_ask import ask_schemas, ask_tools, client_for
    from cortexstream.benchmarks.tool_cases import TOOL_CASES, TOOL_CHOICES

    label = launch.label
    tic = time.perf_counter()
    try:
        server = start_server(launch, model_dir, work, timeout=300)
    except RuntimeError as exc:
        results.add("servers", {"system": label, "started": False, "error": str(exc)[-1500:]})
        log(f"{label}: did not start: {str(exc)[:200]}")
        return
    try:
        client = client_for(server.url, s.timeout)
        for choice in TOOL_CHOICES:
            row = ask_tools(client, server.model, TOOL_CASES, choice, max_tokens=s.max_tokens, workers=s.workers,
                            progress=progress, desc=f"{label} {choice}")
            results.add("tools", {"system": label, "tool_choice": choice, **row})
            log(f"{label} tools {choice}: {row['correct']}/{row['cases']} right calls {row['outcomes']}")
        if s.schemas:
            row = ask_schemas(client, server.model, schema_cases(s.schemas), max_tokens=s.schema_max_tokens,
                              workers=s.workers, progress=progress, desc=f"{label} json_schema")
            results.add("schemas", {"system": label, **row})
            log(f"{label} json_schema: {row['valid']}/{row['cases']} valid {row['outcomes']}")
    finally:
        server.stop()
        results.add("servers", {"system": label, "started": True, "peak_rss_bytes": server.peak_rss,
                                "seconds": round(time.perf_counter() - tic, 1)})


def run(s: ToolBenchSettings, out_dir: str = "bench/results", *, progress: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    from cortexstream.benchmarks.serve import require_httpx
    from cortexstream.benchmarks.tool_bench_report import markdown

    require_httpx()
    launches = s.launches()
    recorded = {"command": command_line(s), "systems": [l.label for l in launches], "workers": s.workers,
                "max_tokens": s.max_tokens, "schemas": s.schemas, "schema_max_tokens": s.schema_max_tokens,
                "tool_parser": s.tool_parser, "model": os.path.basename(s.model) if s.model else
                "qwen2.5-coder-0.5b-instruct.gguf (benchmark asset)"}
    os.makedirs(out_dir, exist_ok=True)
    results = ResultStore(os.path.join(out_dir, f"{NAME}.json"), NAME, recorded, PARTS, resume=False)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cortexstream-bench-tools-") as tmp:
        work = Path(tmp)
        model_dir = _model_dir(s, work)
        for launch in launches:
            measure_server(launch, model_dir, work, s, results, log, progress)
    results.data["runs"].append({"seconds": round(time.perf_counter() - started, 1)})
    write_report(out_dir, NAME, results.data, markdown(results.data))
    return results.data


def command_line(s: ToolBenchSettings) -> str:
    """The command that measures `s` (no local paths: peers by name, the model by its file name)."""
    import shlex

    d, words = ToolBenchSettings(), ["cortexstream", "bench", "tools"]
    if s.model is not None:
        words += ["--model", os.path.basename(s.model)]
    if s.systems != d.systems:
        words += ["--systems", ",".join(s.systems)]
    words += [w for peer in s.peers for w in ("--peer-python", f"{peer.value}=PYTHON")]
    words += [w for peer, key, value in s.variants for w in ("--peer-variant", f"{peer.value}:{key}={value}")]
    for name in ("tool_parser", "workers", "max_tokens", "schemas", "schema_max_tokens"):
        if getattr(s, name) != getattr(d, name):
            words += [f"--{name.replace('_', '-')}", str(getattr(s, name))]
    return shlex.join(words)


def run_from_args(args: argparse.Namespace) -> int:
    from cortexstream.backend import enable_linux_cpu_tuning

    enable_linux_cpu_tuning()
    run(from_args(args), args.out)
    return show_report(args.out, NAME)


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.tool_bench")


__all__ = ["ToolBenchSettings", "add_arguments", "main", "run", "run_from_args"]


if __name__ == "__main__":
    raise SystemExit(main())
