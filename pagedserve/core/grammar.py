"""Structured outputs: a grammar per constrained sequence (llguidance's LLMatcher), and the batch's
token mask. The scheduler owns the matchers with the rest of the request state: it fills the mask
of every constrained row when it forms a step, advances each
matcher by the token the sequence appended, and copies it when an n > 1 request forks. The runner
only applies the mask (a packed bitmask: bit t of row r = token t allowed). Plain Python: no torch."""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from pagedserve.errors import ParamError
from pagedserve.sampling_params import StructuredOutputsParams


# compact JSON with Python's separators: no free whitespace, which a small model otherwise fills with
# newlines and indentation until max_tokens (a schema's "x-guidance" key can ask for other options)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Builds matchers for one tokenizer. The llguidance tokenizer is built on first use (~0.3 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._ll_tokenizer = None
        self._lock = threading.Lock()             # the server compiles in worker threads

    def precompile(self, so: StructuredOutputsParams) -> None:
        """Compile now, off the engine thread (a complex schema can take 100s of ms): the engine then
        only copies the matcher. Raises what matcher() raises."""
        if so.compiled is None:
            so.compiled = self.matcher(so)

    @property
    def words(self) -> int:
        """int32 words per row of the packed mask."""
        return (self.vocab_size + 31) // 32

    def _tok(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import copy

                import llguidance
                # as llguidance.hf.from_tokenizer does, without its transformers import: the Rust tokenizer
                # (added tokens included) as JSON, padding and truncation off
                backend = copy.copy(self.tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._ll_tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=list(self.eos_token_ids) or None)
        return self._ll_tokenizer

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher for `so` (a copy of the one compiled ahead, if any: requests sharing params,
        n > 1 forks and several prompts, each get their own); a schema, regex or grammar it cannot
        compile is a ParamError."""
        if so.compiled is not None:
            return so.compiled.deep_copy()
        import llguidance
        tok = self._tok()
        grammar = _grammar(so)
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise ParamError(so.param, f"{so.param}: cannot compile the constraint: {m.get_error()}")
        return m

    def fill_bitmask(self, matchers: list[Any]) -> np.ndarray:
        """(len(matchers), words) int32: each matcher's allowed next tokens. Computed one after the
        other in this thread: llguidance's parallel executor measured slower here (0.42 vs 0.17 ms for
        64 rows mid-string) and its worker threads slowed the next forward pass (they compete with
        torch's for the 2 cores)."""
        from llguidance.numpy import fill_next_token_bitmask
        mask = np.full((len(matchers), self.words), -1, dtype=np.int32)
        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, mask, i)
        return mask


def _grammar(so: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher
    if so.json is not None:
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ParamError(so.param, f"{so.param}: the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ParamError(so.param, f"{so.param}: a JSON schema must be an object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ParamError(so.param, f"{so.param}: invalid JSON schema: {e}") from None
    if so.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:   # Lark string literals take JSON's escapes
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    grammar = so.grammar
    if "::=" in grammar:        # GBNF (llama.cpp's grammar format), as vLLM's `grammar` accepts
        from llguidance.gbnf_to_lark import gbnf_to_lark
        grammar = gbnf_to_lark(grammar)
    return LLMatcher.grammar_from_lark(grammar)

