"""Shared fixtures: tiny random-init models (no download), the real SmolLM2, and a composed Hydra cfg."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import lab.resolvers  # noqa: F401 - the configs' ${max:...}
from lab.models import native_tiles
from lab.models.sources import ModelSource, smollm2, tiny
from lab.runner import ModelRunner

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

torch.set_num_threads(2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs CUDA")
    if any("amx" in item.keywords for item in items) and not native_tiles.available():
        skips["amx"] = pytest.mark.skip(reason="needs a CPU with AMX-BF16 (and Linux's grant of its tile state)")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_source() -> ModelSource:
    """2 layers, hidden 64, GQA 4/2, vocab 128, fp32, fixed seed: token ids only."""
    return tiny(seed=0, vocab_size=128, with_tokenizer=False)


@pytest.fixture(scope="session")
def tiny_runner(tiny_source: ModelSource) -> ModelRunner:
    return ModelRunner(tiny_source, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_text_runner() -> ModelRunner:
    """The `tiny` model config: random weights with the SmolLM2 tokenizer (vocab 49152)."""
    return ModelRunner(tiny(seed=0), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    return smollm2()


@pytest.fixture(scope="session")
def smollm2_runner(smollm2_source: ModelSource) -> ModelRunner:
    return ModelRunner(smollm2_source, dtype="float32", device="cpu")


def compose_cfg(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=run_dir is not None)


@pytest.fixture
def cfg(tmp_path: Path) -> DictConfig:
    """Tiny model, a few short random prompts, null logger."""
    return compose_cfg(["model=tiny", "logger=none", "workload.num_prompts=3", "workload.input_len=16",
                        "workload.output_len=8", f"hydra.run.dir={tmp_path}"])
