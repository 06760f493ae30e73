"""`cortexstream bench prefix-tier`: the prefix cache's disk tier (`serve --kv-disk DIR`) over real HTTP.

Two parts (`--parts`), each measured `--rounds` times, servers always one at a time:
- restart (prefix_tier_restart.py): TTFT of a repeated document prompt, cold, warm in RAM and after a clean restart
  on the same disk directory, with the tokens the restarted server restored and recomputed; target: cold >= 10x
  the after-restart TTFT;
- agent (prefix_tier_agent.py): concurrent agent sessions resending their growing conversations, CortexStream's
  arena too small for all of them, CortexStream with --kv-disk against mlx_lm.server on the same converted weights
  (and CortexStream without the tier as a reference); targets: mean TTFT <= 0.5x mlx_lm.server's, output tokens/s
  >= 1.3x, peak RSS no higher.
Rows are written to `<out>/prefix_tier.json` (`prefix_tier_quick.json` with --quick) as soon as they are measured;
the medians, the targets and `.md` at the end (prefix_tier_report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from cortexstream.benchmarks.common import show_report, write_report
from cortexstream.benchmarks.prefix_tier_settings import AgentSystem, Part, PrefixTierSettings, from_args
from cortexstream.benchmarks.prefix_tier_settings import add_arguments as add_settings_arguments

NAME = "prefix_tier"
PARTS = tuple(p.value for p in Part)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument("--model", default=None, help="model to serve (default: smollm2-135m); converted once to an "
                        "mlx-lm directory that every server loads")
    parser.add_argument("--out", default="bench/results", help="output folder")


def require_clients() -> None:
    """httpx (the agent part's streaming client, `bench serve`'s) and the openai SDK (the restart part's TTFT)
    come with the `bench` extra: a clear error without them, before anything is converted."""
    from cortexstream.benchmarks.serve import require_httpx
    from cortexstream.errors import CortexStreamError

    require_httpx()
    try:
        import openai  # noqa: F401
    except ImportError:
        raise CortexStreamError("bench prefix-tier times TTFT with the openai SDK, which is not installed: "
                                "pip install openai") from None


def run(settings: PrefixTierSettings, model: str | None, out_dir: str,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure `settings` and write `<out_dir>/<settings.name>.json` and `.md`; the results dict."""
    from transformers import AutoTokenizer

    from cortexstream.benchmarks.machine import neutral_source
    from cortexstream.benchmarks.prefix_tier_agent import agent_run
    from cortexstream.benchmarks.prefix_tier_report import markdown, summaries
    from cortexstream.benchmarks.prefix_tier_restart import restart_round
    from cortexstream.benchmarks.prefix_tier_workloads import (agent_workload, document_messages, tokens_needed,
                                                               wiki_source)
    from cortexstream.benchmarks.result_store import ResultStore
    from cortexstream.benchmarks.serve import convert_to_mlx_lm

    work = Path(tempfile.mkdtemp(prefix="cortexstream-bench-prefix-tier-"))
    try:
        model_dir = work / "model"
        say(f"[bench prefix-tier] converting {model or 'smollm2-135m'} to an mlx-lm directory")
        convert_to_mlx_lm(model, model_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        source = wiki_source(tokenizer, tokens_needed(settings.rounds, settings.doc_tokens, settings.agent))
        documents = [document_messages(source, settings.doc_tokens) for _ in range(settings.rounds)]
        workload = agent_workload(source, settings.agent, settings.seed)
        kv_tokens = workload.kv_tokens(settings.agent.arena_fraction)
        recorded = {"model": neutral_source(model) if model else "smollm2-135m", "command": settings.command(model),
                    "quick": settings.quick, "parts": [p.value for p in settings.parts], "rounds": settings.rounds,
                    "doc_tokens": settings.doc_tokens, "answer_tokens": settings.answer_tokens,
                    "agent": dataclasses.asdict(settings.agent), "agent_workload": workload.spec.description,
                    "kv_tokens": kv_tokens, "final_tokens_total": sum(workload.final_tokens),
                    "system_tokens": list(workload.system_tokens), "seed": settings.seed,
                    "timeout": settings.timeout, "text": source.origin}
        os.makedirs(out_dir, exist_ok=True)
        store = ResultStore(os.path.join(out_dir, f"{settings.name}.json"), NAME, recorded, PARTS, resume=False)
        if Part.RESTART in settings.parts:
            for index, messages in enumerate(documents):
                store.add(Part.RESTART.value, restart_round(index, messages, settings, str(model_dir), work, say))
        if Part.AGENT in settings.parts:
            systems = list(AgentSystem)
            for index in range(settings.rounds):
                order = systems if index % 2 == 0 else systems[::-1]
                for position, system in enumerate(order):
                    store.add(Part.AGENT.value, agent_run(index, position, system, workload, kv_tokens,
                                                          settings.timeout, str(model_dir), work, say))
        data = store.data
        data["summary"] = summaries(data)
        write_report(out_dir, settings.name, data, markdown(data))
        return data
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_from_args(args: argparse.Namespace) -> int:
    """Every option checked before anything is converted or started (each error names its option), then `run`."""
    settings = from_args(args)
    require_clients()
    run(settings, args.model, args.out)
    return show_report(args.out, settings.name)


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.prefix_tier")


__all__ = ["add_arguments", "main", "run", "run_from_args"]


if __name__ == "__main__":
    raise SystemExit(main())
