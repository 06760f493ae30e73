"""What one `bench kv-dtype` run measures: the sizes of every part, checked before anything loads (each error names
the command-line option that sets the field), and the smaller sizes of `--quick`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from enum import Enum

from cortexstream.errors import InvalidArgumentError


class Part(str, Enum):
    MEMORY = "memory"
    PERPLEXITY = "perplexity"
    PASSKEY = "passkey"
    DECODE = "decode"


class PolicyFamily(str, Enum):
    """The families of `quality.policies_for` (the budget is `budget`)."""

    FULL = "full"
    STREAMING = "streaming"
    H2O = "h2o"


AUTO = "auto"


def _positive(values: tuple[int, ...], option: str, minimum: int = 1) -> None:
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        raise InvalidArgumentError(f"{option}: {list(values)} must be integers >= {minimum}")


def _storages(specs: tuple[str, ...], option: str) -> None:
    from cortexstream.kv.kv_dtype import parse_kv_dtype

    for spec in specs:
        try:
            parse_kv_dtype(spec, None, model_dtype="float32")  # the spelling; the model's dtype is checked later
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{option}: {exc}") from None


@dataclass(frozen=True)
class KVDtypeSettings:
    """Sizes of a run. `storages` empty: the model's float type, float16 if different, int8, int4, k=int8,v=int4;
    `passkey_storages` / `decode_storages` empty: the model's float type, int8 and int4 (a passkey cell costs
    several times a perplexity cell: every trial recomputes the haystack after its needle)."""

    contexts: tuple[int, ...] = (2048, 4096)
    storages: tuple[str, ...] = ()
    group_size: int = 64
    budget: float = 0.25
    ppl_chunk: int = 16
    passkey_contexts: tuple[int, ...] = (2048, 4096)
    passkey_storages: tuple[str, ...] = ()
    passkey_policies: tuple[PolicyFamily, ...] = (PolicyFamily.FULL, PolicyFamily.H2O)
    passkey_trials: int = 5
    passkey_chunk: int = 64
    batches: tuple[int, ...] = (1, 8)
    decode_keys: tuple[int, ...] = (512, 4096)
    decode_storages: tuple[str, ...] = ()
    decode_policies: tuple[PolicyFamily, ...] = (PolicyFamily.FULL,)
    decode_steps: int = 16
    rounds: int = 3
    parts: tuple[Part, ...] = tuple(Part)
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(self.contexts, "--contexts", 16)
        _positive(self.passkey_contexts, "--passkey-contexts", 256)  # the passkey prompt's fixed text needs room
        _positive(self.batches, "--batches")
        _positive(self.decode_keys, "--decode-keys", 16)
        for option in ("ppl_chunk", "passkey_trials", "passkey_chunk", "decode_steps", "rounds"):
            _positive((getattr(self, option),), "--" + option.replace("_", "-"))
        if self.group_size not in (32, 64):
            raise InvalidArgumentError(f"--group-size: {self.group_size!r} must be 32 or 64")
        if not 0 < self.budget <= 1:
            raise InvalidArgumentError(f"--budget: {self.budget!r} must be a fraction in (0, 1]")
        _storages(self.storages, "--kv-dtypes")
        _storages(self.passkey_storages, "--passkey-kv-dtypes")
        _storages(self.decode_storages, "--decode-kv-dtypes")
        object.__setattr__(self, "parts", _members(self.parts, Part, "--parts"))
        object.__setattr__(self, "passkey_policies", _members(self.passkey_policies, PolicyFamily,
                                                              "--passkey-policies"))
        object.__setattr__(self, "decode_policies", _members(self.decode_policies, PolicyFamily,
                                                             "--decode-policies"))

    def quick(self) -> "KVDtypeSettings":
        """A smoke run of every part: 256-token contexts, 2 passkey trials, 128 keys, 4 steps, 1 round."""
        return replace(self, contexts=(256,), passkey_contexts=(256,), passkey_trials=2, decode_keys=(128,),
                       decode_steps=4, rounds=1)


def _members(values: tuple, kind: type[Enum], option: str) -> tuple:
    try:
        members = tuple(kind(v) for v in values)
    except ValueError:
        members = ()
    if not members:
        raise InvalidArgumentError(f"{option}: {[getattr(v, 'value', v) for v in values]} must name some of "
                                   f"{', '.join(m.value for m in kind)}")
    return members


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes as options (defaults: `KVDtypeSettings`)."""
    d = KVDtypeSettings()

    def ints(values: tuple[int, ...]) -> str:
        return ",".join(map(str, values))

    parser.add_argument("--parts", default=",".join(p.value for p in d.parts), help="comma-separated parts to run")
    parser.add_argument("--contexts", default=ints(d.contexts), help="perplexity contexts (tokens)")
    parser.add_argument("--kv-dtypes", default=AUTO,
                        help="semicolon-separated storages, e.g. 'float32;int8;int4;k=int8,v=int4' (auto: the "
                             "model's float type, float16 if different, int8, int4, k=int8,v=int4)")
    parser.add_argument("--group-size", type=int, default=d.group_size, help="group of the int8/int4 sides: 32 or 64")
    parser.add_argument("--budget", type=float, default=d.budget, help="StreamingLLM / H2O budget (fraction)")
    parser.add_argument("--ppl-chunk", type=int, default=d.ppl_chunk, help="tokens scored between evictions")
    parser.add_argument("--passkey-contexts", default=ints(d.passkey_contexts))
    parser.add_argument("--passkey-kv-dtypes", default=AUTO,
                        help="semicolon-separated storages for passkey retrieval (auto: the model's float type, int8, "
                             "int4)")
    parser.add_argument("--passkey-policies", default=",".join(p.value for p in d.passkey_policies),
                        help=f"comma-separated among {', '.join(p.value for p in PolicyFamily)} (at --budget)")
    parser.add_argument("--passkey-trials", type=int, default=d.passkey_trials)
    parser.add_argument("--passkey-chunk", type=int, default=d.passkey_chunk)
    parser.add_argument("--batches", default=ints(d.batches), help="decode batch sizes")
    parser.add_argument("--decode-keys", default=ints(d.decode_keys), help="prompt tokens (keys) of each request")
    parser.add_argument("--decode-kv-dtypes", default=AUTO,
                        help="semicolon-separated storages to time (auto: the model's float type, int8, int4)")
    parser.add_argument("--decode-policies", default=",".join(p.value for p in d.decode_policies),
                        help=f"comma-separated among {', '.join(p.value for p in PolicyFamily)} (at --budget): "
                             "each request of the timed batch evicts to the budget as it decodes")
    parser.add_argument("--decode-steps", type=int, default=d.decode_steps, help="timed steps per storage and round")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="decode rounds (the storage order rotates)")


def from_args(args: argparse.Namespace) -> KVDtypeSettings:
    """The settings the options ask for (`--quick`: their smoke-run sizes)."""
    from cortexstream.cli.number_lists import int_list, name_list

    def storages(text: str, option: str) -> tuple[str, ...]:
        specs = tuple(x.strip() for x in text.split(";") if x.strip())
        if not specs:
            raise InvalidArgumentError(f"{option}: give '{AUTO}' or storages separated by ';'")
        return () if specs == (AUTO,) else specs

    settings = KVDtypeSettings(
        contexts=int_list(args.contexts, "--contexts", 16), storages=storages(args.kv_dtypes, "--kv-dtypes"),
        group_size=args.group_size, budget=args.budget, ppl_chunk=args.ppl_chunk,
        passkey_contexts=int_list(args.passkey_contexts, "--passkey-contexts", 256),
        passkey_storages=storages(args.passkey_kv_dtypes, "--passkey-kv-dtypes"),
        passkey_policies=name_list(args.passkey_policies), passkey_trials=args.passkey_trials,
        passkey_chunk=args.passkey_chunk, batches=int_list(args.batches, "--batches", 1),
        decode_keys=int_list(args.decode_keys, "--decode-keys", 16),
        decode_storages=storages(args.decode_kv_dtypes, "--decode-kv-dtypes"),
        decode_policies=name_list(args.decode_policies), decode_steps=args.decode_steps,
        rounds=args.rounds, parts=name_list(args.parts))
    return settings.quick() if args.quick else settings


__all__ = ["AUTO", "KVDtypeSettings", "Part", "PolicyFamily", "add_arguments", "from_args"]
