"""Grammar-constrained output (llguidance): what a request's output must match, and its per-token masks."""

from cortexstream.grammar.spec import GrammarKind, GrammarSpec, grammar_for

__all__ = ["GrammarKind", "GrammarSpec", "grammar_for"]
