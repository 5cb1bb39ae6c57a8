"""Incremental detokenization and stop strings for one streamed request.

Owns: turning output token ids, a few at a time, into text deltas; cutting the text at a stop string and
holding back a tail that could still become one. Ignores: HTTP and engines.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to
CONTEXT_TOKENS = 4            # tokens decoded before the new ones, so merges and leading spaces come out right


class IncrementalDetokenizer:
    """Decodes only a short window (a few tokens before the new ones), so each step costs O(1), not O(n).

    NOTE: decoding the new tokens alone can differ from the full decode (byte-level pieces, a sentencepiece
    leading space); decoding `context + new` and keeping what follows `decode(context)` avoids that.
    """

    def __init__(self, tokenizer: Any | None, stop: list[str] | None = None, is_streaming: bool = False,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.is_streaming = is_streaming
        # NOTE: vLLM's: keep the stop string, or the EOS / stop token's text, that ended the output
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.read_offset = 0       # tokens already turned into text
        self.text = ""             # all text so far (cut at a stop string once one matched)
        self.num_sent_chars = 0    # characters handed to the client
        self.is_stopped = False    # a stop string matched

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, is_final: bool) -> str:
        if self.tokenizer is None or self.read_offset == len(self.token_ids):
            return ""
        start = max(0, self.read_offset - CONTEXT_TOKENS)
        prefix = self._decode(self.token_ids[start:self.read_offset])
        full = self._decode(self.token_ids[start:])
        if full.endswith(REPLACEMENT_CHAR) and not is_final:
            return ""  # an incomplete UTF-8 character: wait for the next token
        self.read_offset = len(self.token_ids)
        return full[len(prefix):] if full.startswith(prefix) else full

    def add(self, new_token_ids: list[int], is_final: bool = False, stop_token_ended: bool = False) -> str:
        """Append tokens; returns the text now safe to send (empty while bytes or a stop string are pending).
        stop_token_ended: the last token is the EOS or stop token that ended the request (its text is left out)."""
        if self.is_stopped:
            return ""
        if stop_token_ended and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        self.token_ids.extend(new_token_ids)
        previous_len = len(self.text)
        self.text += self._decode_new(is_final)
        if self.stop:
            self._match_stop(previous_len)
        hold = 0
        if self.stop and self.is_streaming and not (is_final or self.is_stopped):
            hold = max(len(s) for s in self.stop) - 1  # NOTE: the tail may be the start of a stop string
        end = max(self.num_sent_chars, len(self.text) - hold)
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta

    def _match_stop(self, previous_len: int) -> None:
        longest = max(len(s) for s in self.stop)
        search_from = max(0, previous_len - longest + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            # NOTE: vLLM's default: the stop string is not part of the output (include_stop_str_in_output keeps it)
            end = min(hits)
            if self.include_stop_str_in_output:
                end += next(len(s) for s in self.stop if self.text.startswith(s, end))
            self.text = self.text[:end]
            self.is_stopped = True
