"""Structured outputs (vLLM's `StructuredOutputsParams`; OpenAI's `response_format`): the output must match a JSON
schema, any JSON object, a regex, one of several strings, or a Lark grammar. At every step the request's grammar
says which tokens may come next and the others' logits become -inf, before any sampling; once the grammar is
complete only EOS is allowed, so the request ends with finish_reason "stop".

The grammars are llguidance's (the Rust engine behind vLLM's `guidance` backend and llama.cpp's): it compiles a
schema in milliseconds, computes a token mask over a 49k vocabulary in well under a millisecond, and rolls its
state back, which verifying drafted tokens needs. A well-kept library beats writing a JSON-schema-to-automaton
compiler here.

Owns: the parameters, compiling them against a tokenizer, each request's matcher and its token masks.
Ignores: which engines apply the masks (lab/sample/logits_processors.py does) and the wire format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher

from lab.errors import LabError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's field names): `json` a JSON schema (a dict or its text), `regex`, `choice`
    (the output is one of these strings), `grammar` (Lark, llguidance's dialect), `json_object` (any JSON object).
    `disable_any_whitespace` allows no whitespace between JSON tokens (vLLM's; by default any is allowed)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise LabError(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                           f"{', '.join(given) if given else 'none'}",
                           "give one constraint per request (e.g. a JSON schema, or a regex)")
        if self.choice is not None:
            choices = self.choice
            if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise LabError(f"choice must be a list of non-empty strings, got {self.choice!r}",
                               "list the strings the output may be, e.g. [\"yes\", \"no\"]")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise LabError(f"the JSON schema is not valid JSON: {exc}",
                               "send the schema as a JSON object") from None

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet checked: compiling it against a tokenizer does)."""
        options = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as exc:
                raise LabError(f"the JSON schema is not a JSON object: {exc}", "send a JSON schema object") from None
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # NOTE: Lark string literals take JSON's escapes, so any string (quotes, newlines) is matched literally
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar or "")


class RequestGrammar:
    """One request's matcher. The engine appends tokens to the request; `catch_up` consumes those the matcher has not
    seen; `allowed` then consumes (for a verify row) the drafted tokens before that row, and rolls them back."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size          # the tokenizer's: the model's logits may have padding columns
        self.num_consumed = 0

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Consume the request's output tokens not yet consumed (the engine appended them after the last mask). Once
        the grammar is complete, nothing more is consumed: with ignore_eos the request goes on emitting EOS."""
        new = output_token_ids[self.num_consumed:]
        if self.is_terminated and not self.matcher.is_error():
            new = []
        if new and not self.matcher.consume_tokens(new):
            raise LabError(f"the output broke its grammar: {self.matcher.get_error()}",
                           "report this: the engine sampled a token its grammar had masked")
        self.num_consumed = len(output_token_ids)

    def allowed(self, drafted: list[int] = ()) -> torch.Tensor:
        """(V_tokenizer,) bool: the tokens the grammar allows after the consumed tokens and then `drafted`. A draft
        the grammar refuses makes the rows after it unreachable (the verify rejects it first, its logit being -inf):
        those rows get the mask where the valid drafts end."""
        num = self.matcher.try_consume_tokens(list(drafted)) if drafted else 0
        try:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        finally:
            if num:
                self.matcher.rollback(num)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool))

    def forced_tokens(self, output_token_ids: list[int]) -> list[int]:
        """After the request's output: the tokens the grammar leaves no choice about next (llguidance's fast-forward
        tokens: a JSON key after its opening quote, say); empty once the grammar is complete."""
        self.catch_up(output_token_ids)
        return [] if self.is_terminated else self.matcher.compute_ff_tokens()

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (or broken): only EOS may follow."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles structured-output parameters against one tokenizer (llguidance's view of it is built once, ~1 s)."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer is None:
            raise LabError("structured outputs need the model's tokenizer; this model has token ids only",
                           "use a model with a tokenizer (model=smollm2, or model=tiny with its default tokenizer)")
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        except ValueError as exc:
            raise LabError(f"structured outputs need a fast (Rust) tokenizer: {exc}",
                           "load the model's tokenizer with use_fast=True") from None

    def compile(self, params: StructuredOutputsParams) -> RequestGrammar:
        matcher = LLMatcher(self.tokenizer, params.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise LabError(f"the {params.kind} constraint does not compile: {matcher.get_error()}",
                           f"fix the {params.kind} (llguidance's syntax: Rust regexes, Lark grammars, JSON Schema)")
        return RequestGrammar(matcher, self.tokenizer.vocab_size)
