"""GrammarCompiler: a request's `StructuredOutputs` -> a `RequestGrammar`, compiling each distinct
constraint once per tokenizer and caching it.

Compiling a constraint (llguidance builds its lexer and parser tables) is the costly part; a
request then gets a copy of the compiled matcher (`deep_copy`, microseconds). The cache belongs to
the compiler, one per engine (so per tokenizer), keyed by the constraint's kind and text; it is
thread-safe, so a server may compile off the engine thread (`compile`) before the request is
added. llguidance's tokenizer view (built once, lazily, ~0.3 s for a 49k vocabulary) covers the
model's vocabulary size (which may exceed the tokenizer's); EOS ids are the engine's.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Sequence

from jaxinfer.sampling_params import StructuredOutputs
from jaxinfer.structured.matcher import RequestGrammar

DEFAULT_CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)
# JSON is generated compact (", " and ": " separators, no other whitespace): flexible whitespace
# lets a weak model emit blanks until max_tokens; a schema's "x-guidance" options still override
_JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self.num_compiled = 0  # cache misses (distinct constraints compiled)

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids or None)
            return self._ll_tokenizer

    def compile(self, constraint: StructuredOutputs):
        """The compiled matcher of `constraint` (cached); ValueError naming the problem when the
        schema, regex or grammar is invalid."""
        import llguidance

        key = constraint.kind_and_text()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        kind, text = key
        try:
            grammar = (llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)
                       if kind == "json" else llguidance.grammar_from(kind, text))
        except ValueError as e:
            raise ValueError(f"invalid structured_outputs.{_field(constraint)}: {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured_outputs.{_field(constraint)}: "
                             f"{matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def request_grammar(self, constraint: StructuredOutputs) -> RequestGrammar:
        """A fresh matcher at the grammar's start, for one request."""
        return RequestGrammar(self.compile(constraint).deep_copy(), self.vocab_size)


def _field(constraint: StructuredOutputs) -> str:
    kind = constraint.kind_and_text()[0]
    return "json_object" if constraint.json_object else kind
