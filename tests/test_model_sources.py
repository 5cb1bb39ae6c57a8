"""The bundled model's one-time conversion (lab/models/sources.py): callers that need it at the same time (a
sweep's parallel jobs on a new machine) convert it once and all get the result."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from lab.models import sources


def test_concurrent_callers_convert_the_bundled_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conversions = []

    def fake_convert(gguf: Path, target: Path) -> None:
        conversions.append(target)
        time.sleep(0.3)   # NOTE: long enough that the other caller arrives while this one holds the lock
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(sources, "find_smollm2_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(sources, "_convert_gguf", fake_convert)
    results: list[Path] = []
    callers = [threading.Thread(target=lambda: results.append(sources.convert_smollm2(tmp_path / "cache")))
               for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert conversions == [tmp_path / "cache" / "smollm2-135m-instruct"]
    assert results == [conversions[0]] * 3
    assert sources.convert_smollm2(tmp_path / "cache") == conversions[0] and len(conversions) == 1
