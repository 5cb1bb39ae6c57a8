"""FileWorkload: a JSONL file, one request a line: {"prompt": str} or {"messages": [...]} (chat template
applied), optional "max_tokens". Every malformed line is reported with its line number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lab.errors import LabError
from lab.request import Request
from lab.workloads.base import SamplingDefaults


def encode_record(record: dict[str, Any], tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A prompt (plain text) or a conversation (through the chat template, with `tools` if given) as token ids."""
    if "messages" in record:
        ids = tokenizer.apply_chat_template(record["messages"], tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(record["prompt"], add_special_tokens=False)


def _check_record(record: Any, where: str) -> None:
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise LabError(f"{where}: expected an object with exactly one of \"prompt\" or \"messages\"",
                       'write each line as {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}')
    if "prompt" in record and not (isinstance(record["prompt"], str) and record["prompt"]):
        raise LabError(f"{where}: \"prompt\" must be a non-empty string, got {record['prompt']!r}",
                       "put the prompt text in a JSON string")
    if "messages" in record and not (isinstance(record["messages"], list) and record["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in record["messages"])):
        raise LabError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects "
                       "with string values", 'use [{"role": "user", "content": "..."}]')
    max_tokens = record.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0):
        raise LabError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}",
                       "remove it to use workload.max_tokens, or give a positive integer")


class FileWorkload:
    def __init__(self, path: str | None = None, max_tokens: int = 64, ignore_eos: bool = False,
                 name: str = "file") -> None:
        if not path:
            raise LabError("workload=file needs a prompts file", "pass workload.path=/path/to/prompts.jsonl")
        self.path, self.max_tokens, self.ignore_eos, self.name = Path(path).expanduser(), max_tokens, ignore_eos, name
        if max_tokens <= 0:
            raise LabError(f"workload.max_tokens must be > 0, got {max_tokens}", "set workload.max_tokens=32 (or any positive number)")

    def read_records(self) -> list[tuple[int, dict[str, Any]]]:
        if not self.path.is_file():
            raise LabError(f"prompts file not found: {self.path}", "check workload.path (relative paths are taken from the directory you launched from)")
        records = []
        for line_number, raw in enumerate(self.path.read_bytes().splitlines(), start=1):
            where = f"{self.path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise LabError(f"{where}: not UTF-8 text (byte {exc.start + 1})", "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LabError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})",
                               "make every line one JSON object") from None
            _check_record(record, where)
            records.append((line_number, record))
        if not records:
            raise LabError(f"prompts file {self.path} has no requests", "add one JSON object per line")
        return records

    def build(self, tokenizer: Any | None, vocab_size: int, sampling: SamplingDefaults) -> list[Request]:
        if tokenizer is None:
            raise LabError("workload=file needs a model with a tokenizer", "use model=smollm2, model=tiny or model=hf")
        requests = []
        for line_number, record in self.read_records():
            try:
                token_ids = encode_record(record, tokenizer)
            except Exception as exc:  # noqa: BLE001 - a chat template that rejects the conversation (roles, order)
                raise LabError(f"{self.path}:{line_number}: the chat template rejected the messages: {exc}",
                               "give the roles and order the model's chat template expects") from None
            params = sampling.params(record.get("max_tokens") or self.max_tokens, self.ignore_eos)
            prompt = record["prompt"] if "prompt" in record else json.dumps(record["messages"])
            requests.append(Request(f"{self.name}-{line_number}", token_ids, params, prompt=prompt))
        return requests
