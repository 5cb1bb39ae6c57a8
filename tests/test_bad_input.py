"""Bad input gets one clear error naming the problem and the fix (exit code 2), never a traceback wall."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.errors import LabError
from lab.request import SamplingParams
from lab.workloads import FileWorkload, SamplingDefaults
from tests.test_run import lab_cli


def _assert_clean_error(proc, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, f"{needle!r} not in stderr:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("group", ["engine", "model", "workload"])
def test_unknown_group_name_lists_the_options(group: str, tmp_path: Path) -> None:
    proc = lab_cli(f"{group}=no_such_thing", f"hydra.run.dir={tmp_path}")
    _assert_clean_error(proc, f"Could not find '{group}/no_such_thing'", "Available options")


def test_prompt_longer_than_context(tmp_path: Path) -> None:
    proc = lab_cli("model=tiny", "model.max_model_len=64", "workload.input_len=100", "workload.num_prompts=1",
                   f"hydra.run.dir={tmp_path}")
    _assert_clean_error(proc, "exceeds the model's context (64)", "fix:")
    assert proc.returncode == 2


def test_non_positive_max_tokens(tmp_path: Path) -> None:
    proc = lab_cli("model=tiny", "workload.output_len=0", f"hydra.run.dir={tmp_path}")
    _assert_clean_error(proc, "output_len must be >= 1", "fix:")
    with pytest.raises(LabError, match="max_tokens must be > 0"):
        SamplingParams(max_tokens=0)


def test_missing_prompts_file(tmp_path: Path) -> None:
    proc = lab_cli("model=tiny", "workload=file", f"workload.path={tmp_path}/nope.jsonl",
                   f"hydra.run.dir={tmp_path / 'run'}")
    _assert_clean_error(proc, "prompts file not found", "nope.jsonl")
    assert (tmp_path / "run" / "error.json").is_file()


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "ok"', "malformed JSON"),
    ('{"text": "no prompt key"}', 'exactly one of "prompt" or "messages"'),
    ('{"prompt": 3}', '"prompt" must be a non-empty string'),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "user", "content": 5}]}', '"messages" must be a non-empty list'),
    ('{"prompt": "caf\udcff"}', "not UTF-8 text"),
    ('{"prompt": "x", "max_tokens": -1}', "max_tokens must be a positive integer"),
    ('{"messages": "hi"}', '"messages" must be a non-empty list'),
])
def test_malformed_jsonl_line_is_reported_with_its_line_number(line: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(('{"prompt": "fine"}\n\n' + line + "\n").encode("utf-8", "surrogateescape"))
    with pytest.raises(LabError, match=message) as info:
        FileWorkload(str(path)).build(tokenizer=object(), vocab_size=10, sampling=SamplingDefaults())
    assert f"{path}:3" in str(info.value)


def test_malformed_line_through_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": \n')
    proc = lab_cli("model=tiny", "workload=file", f"workload.path={path}", f"hydra.run.dir={tmp_path / 'run'}")
    _assert_clean_error(proc, f"{path}:2: malformed JSON")


def test_unknown_dtype(tmp_path: Path) -> None:
    proc = lab_cli("model=tiny", "model.dtype=float8", f"hydra.run.dir={tmp_path}")
    _assert_clean_error(proc, "unknown model.dtype 'float8'")
