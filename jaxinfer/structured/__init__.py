"""Structured output: a request's constraint (JSON schema, regex, choice, grammar) compiled once to
a grammar (llguidance) and, per step, its allowed-token bitmask. Host-only (no JAX)."""

from jaxinfer.structured.compiler import GrammarCompiler
from jaxinfer.structured.matcher import RequestGrammar, bitmask_words

__all__ = ["GrammarCompiler", "RequestGrammar", "bitmask_words"]
