"""Config groups are checked against what they build: unknown keys, missing required ones and mistyped values are
one clear error naming the key; every shipped config passes."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from omegaconf import OmegaConf

from lab.config_check import check_call, check_target_config
from lab.errors import LabError
from lab.training.data import DataConfig
from lab.training.recipe import TrainConfig
from lab.workloads import SamplingDefaults
from tests.conftest import CONF_DIR, compose_cfg
from tests.test_bad_input import _assert_clean_error
from tests.test_run import REPO

ENGINE_RUN_KEYS = ("runner", "seed")


def _names(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def _check_run_groups(overrides: list[str]) -> None:
    cfg = compose_cfg(overrides)
    values = OmegaConf.to_container(cfg, resolve=True)
    check_target_config(values["engine"], "engine", ENGINE_RUN_KEYS)
    check_target_config(values["model"]["source"], "model.source")
    for group in ("logger", "metrics", "profiler"):
        check_target_config(values[group], group)
    workload = {k: v for k, v in values["workload"].items()
                if k not in ("request_rate", "burstiness", "max_concurrency", "num_warmups")}
    check_target_config(workload, "workload")
    check_call(SamplingDefaults, values["sampling"], "sampling")


@pytest.mark.parametrize("engine", _names("engine"))
def test_every_engine_config_passes(engine: str) -> None:
    _check_run_groups([f"engine={engine}"])


@pytest.mark.parametrize("proposer", _names("engine/proposer"))
def test_every_proposer_config_passes(proposer: str) -> None:
    _check_run_groups(["engine=speculative", f"engine/proposer={proposer}"])


@pytest.mark.parametrize("group", ["workload", "model", "logger", "profiler"])
def test_every_other_group_config_passes(group: str) -> None:
    for name in _names(group):
        _check_run_groups([f"{group}={name}"] + (["workload.path=x.jsonl"] if name == "file" else []))


@pytest.mark.parametrize("drafter", _names("drafter"))
def test_training_configs_pass(drafter: str) -> None:
    from hydra import compose, initialize_config_dir

    from lab.training.recipe import check_drafter_options

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"drafter={drafter}"])
    check_call(DataConfig, OmegaConf.to_container(cfg.data, resolve=True), "data")
    check_call(TrainConfig, OmegaConf.to_container(cfg.train, resolve=True), "train")
    options = OmegaConf.to_container(cfg.drafter, resolve=True)
    check_drafter_options(options.pop("name"), options)


@dataclass
class _Settings:
    count: int
    rate: float = 1.0
    ratio: float | None = None
    mode: Literal["fast", "exact"] = "fast"
    sizes: list[int] | None = None
    enabled: bool = True
    name: str = "x"


@pytest.mark.parametrize("values, message", [
    ({"count": "abc"}, "cfg.count must be an integer, got 'abc'"),
    ({"count": 1.5}, "cfg.count must be an integer, got 1.5"),
    ({"count": True}, "cfg.count must be an integer, got True"),
    ({"count": 1, "rate": "fast"}, "cfg.rate must be a number"),
    ({"count": 1, "ratio": "x"}, "cfg.ratio must be a number or null"),
    ({"count": 1, "mode": "slow"}, "cfg.mode must be one of 'fast', 'exact'"),
    ({"count": 1, "sizes": 4}, "cfg.sizes must be a list of integers or null"),
    ({"count": 1, "sizes": [1, "b"]}, "cfg.sizes must be a list of integers or null"),
    ({"count": 1, "enabled": 1}, "cfg.enabled must be true or false"),
    ({"count": 1, "cuont": 2}, "did you mean cfg.count?"),
    ({"rate": 2.0}, "cfg.count is required"),
])
def test_mistakes_are_named(values: dict, message: str) -> None:
    with pytest.raises(LabError, match="fix:") as info:
        check_call(_Settings, values, "cfg")
    assert message in str(info.value)


def test_fitting_values_pass() -> None:
    check_call(_Settings, {"count": 2, "rate": 3, "ratio": None, "mode": "exact", "sizes": [1, 2], "enabled": False,
                           "name": 7}, "cfg")


def test_nested_targets_are_checked_with_their_path() -> None:
    cfg = OmegaConf.to_container(compose_cfg(["engine=dflash", "engine.proposer.tree_width=abc"]), resolve=True)
    with pytest.raises(LabError, match="engine.proposer.tree_width must be an integer, got 'abc'"):
        check_target_config(cfg["engine"], "engine", ENGINE_RUN_KEYS)


@pytest.mark.parametrize("override, message", [
    ("model.max_model_len=abc", "model.max_model_len must be an integer or null, got 'abc'"),
    ("+model.max_len=64", "did you mean model.max_model_len?"),
    ("threads=abc", "threads must be an integer or null, got 'abc'"),
    ("seed=1.5", "seed must be an integer, got 1.5"),
    ("workload.max_concurrency=0.5", "workload.max_concurrency must be an integer or null, got 0.5"),
    ("workload.num_warmups=abc", "workload.num_warmups must be an integer >= 0 or null"),
    ("+metrics.slo.ttft=100", "metrics.slo.ttft is not a goodput SLO"),   # vLLM's name; ours: ttft_ms
    ("workload.num_warmups=-1", "workload.num_warmups must be an integer >= 0 or null"),
    ("threads=0", "threads must be >= 1 or null"),
    ("workload.request_rate=-1", "workload.request_rate must be > 0"),   # a range, before the model loads
    ("metrics.slo.tpot_ms=-1", "metrics.slo.tpot_ms must be a number of ms >= 0 or null, got -1"),
])
def test_run_settings_beside_the_targets(override: str, message: str) -> None:
    from lab.run import check_run_config

    with pytest.raises(LabError) as info:
        check_run_config(compose_cfg(["model=tiny", override]))
    assert message in str(info.value)


@pytest.mark.parametrize("target, message", [
    ("lab.workloads.NoSuchWorkload", "lab.workloads has no 'NoSuchWorkload'"),
    ("no_such_package.Thing", "no module 'no_such_package'"),
])
def test_unknown_target(target: str, message: str) -> None:
    with pytest.raises(LabError, match=message):
        check_target_config({"_target_": target}, "workload")


@pytest.mark.parametrize("module, overrides, message", [
    ("lab.run", ["workload=mtbench", "workload.output_len=abc"],
     "workload.output_len must be an integer or null, got 'abc'"),
    ("lab.run", ["+engine.bogus=1"], "engine has no setting 'bogus'"),
    ("lab.run", ["+workload.num_prompt=3"], "did you mean workload.num_prompts?"),
    ("lab.run", ["+sampling.temprature=0.5"], "did you mean sampling.temperature?"),
    ("lab.train", ["logger=none", "+train.stepz=3"], "did you mean train.steps?"),
    ("lab.train", ["logger=none", "data.num_prompts=many"], "data.num_prompts must be an integer"),
    ("lab.train", ["logger=none", "+drafter.gama=5"], "did you mean drafter.gamma?"),
    ("lab.train", ["logger=none", "train.batch_size=0"], "train.batch_size must be >= 1, got 0"),
    ("lab.train", ["logger=none", "output=/proc/nope/x.pt"], "output=/proc/nope/x.pt: cannot create /proc/nope"),
    ("lab.run", ["seed=abc"], "seed must be an integer, got 'abc'"),
    ("lab.serve", ["+engine.bogus=1"], "engine has no setting 'bogus'"),
    ("lab.serve", ["model.source.num_hidden_layers=two"], "model.source.num_hidden_layers must be an integer"),
])
def test_console_scripts_name_the_key_before_loading(module: str, overrides: list[str], message: str,
                                              tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "model=tiny", *overrides,
                           f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    _assert_clean_error(proc, message, "fix:")
    assert proc.returncode == 2


@pytest.mark.parametrize("kind, options, message", [
    ("dflash", {"gama": 5.0}, "did you mean drafter.gamma?"),
    ("eagle", {"block_size": 8}, "drafter has no option 'block_size' (the eagle drafter and its recipe take"),
    ("medusa", {}, "unknown drafter 'medusa'"),
    ("dflash", {"num_layers": "two"}, "drafter.num_layers must be an integer, got 'two'"),
])
def test_drafter_options_are_checked(kind: str, options: dict, message: str) -> None:
    from lab.training.recipe import check_drafter_options

    with pytest.raises(LabError) as info:
        check_drafter_options(kind, options)
    assert message in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("api=grpc", "api must be one of 'completions', 'chat', got 'grpc'"),
    ("percentiles=[50,abc]", "percentiles must be a list of numbers"),
    ("warmup_max_tokens=0", "warmup_max_tokens must be >= 1 or null"),
    ("+slo.e2el=500", "slo.e2el is not a goodput SLO"),
    ("workload.input_len=long", "workload.input_len must be an integer"),
])
def test_bench_serve_settings_are_checked_before_any_request(override: str, message: str, tmp_path: Path) -> None:
    from lab.bench_serve import bench
    from tests.test_bench_serve import compose_cfg_bench

    with pytest.raises(LabError) as info:
        bench(compose_cfg_bench(["endpoint=http://127.0.0.1:9/v1", override]), tmp_path)
    assert message in str(info.value)


@pytest.mark.parametrize("experiment", [[], ["+experiment=serving"], ["+experiment=serving_spec"]])
def test_shipped_bench_serve_options_pass(experiment: list[str]) -> None:
    from lab.bench_serve import BenchOptions
    from tests.test_bench_serve import compose_cfg_bench

    options = BenchOptions.from_cfg(compose_cfg_bench(experiment))
    assert options.percentiles == [50, 90, 95, 99]
