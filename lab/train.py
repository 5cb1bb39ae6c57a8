"""`lab-train` / `python -m lab.train drafter=<eagle|dflash>`: train a drafter for the configured target.

    lab-train drafter=dflash                      # smollm2, writes checkpoints/smollm2/dflash.pt
    lab-train drafter=eagle train.steps=300 output=/tmp/eagle.pt
    lab-train drafter=dflash 'data.mix=[{dataset:gsm8k,num_prompts:1000,holdout:256,share:0.5}]'   # two datasets

Data (the target's own answers to ShareGPT prompts) and target features are made once and cached under
$LAB_CACHE/train/<target fingerprint>/. The checkpoint records this exact command. Each run is one W&B run
(logger=wandb, offline by default; group `train-<drafter>`): the training and validation curves keyed by
step, the final metrics as its summary and the checkpoint as a `model` artifact; logger=none turns it off.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lab.config_check import check_group, checked_kwargs
from lab.run import CONF_DIR, check_model_config
from lab.runner import ModelRunner
from lab.drafters.checkpoint import resolve_checkpoint
from lab.errors import LabError
from lab.hydra_job import console_script, exit_on_lab_error
from lab.training.data import DataConfig
from lab.training.recipe import TrainConfig, check_drafter_options, train_drafter


def train(cfg: DictConfig) -> dict[str, float]:
    # NOTE: every group checked before the target loads (lab/config_check.py)
    check_model_config(cfg)
    check_group(cfg, "logger")
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    data = DataConfig(**checked_kwargs(DataConfig, cfg.data, "data"))
    train_cfg = TrainConfig(**checked_kwargs(TrainConfig, cfg.train, "train"))
    options = OmegaConf.to_container(cfg.drafter, resolve=True)
    kind = options.pop("name")
    check_drafter_options(kind, options)
    output = resolve_checkpoint(cfg.output)
    try:   # NOTE: before training, not after it: a path that cannot be written would lose the trained weights
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LabError(f"output={cfg.output}: cannot create {output.parent} ({exc.strerror})",
                       "set output to a writable path") from None
    source = instantiate(cfg.model.source)
    target = ModelRunner(source, dtype="float32", device=cfg.model.device)
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    command = "lab-train " + " ".join(shlex.quote(o) for o in overrides)
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()
    logger = instantiate(cfg.logger)
    logger.start(run_dir=run_dir, name=" ".join(overrides) or kind, group=f"train-{kind}",
                 config=OmegaConf.to_container(cfg, resolve=True))
    exit_code = 1
    try:
        metrics = train_drafter(kind, target, data, train_cfg, options, output, command.strip(),
                                logger=logger)
        exit_code = 0
        return metrics
    finally:
        logger.finish(exit_code)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except Exception as raw:  # noqa: BLE001 - one message and exit 2 for bad input
        exit_on_lab_error(raw)


cli = console_script(main)   # NOTE: the `lab-train` console script

if __name__ == "__main__":
    cli()
