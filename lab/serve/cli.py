"""`lab-serve` / `python -m lab.serve`: compose model + engine + serve options with Hydra (conf/serve.yaml)
and serve the OpenAI API until SIGINT/SIGTERM. With `serve.replicas=N`, N engine processes behind a
router; with `serve.tensor_parallel=N` (under torchrun), rank 0 serves and every rank steps the engine.

The only module of lab.serve that touches DictConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lab.config_check import check_target_config
from lab.engines.base import Engine
from lab.hydra_job import console_script, exit_on_lab_error
from lab.run import build_runner, check_model_config
from lab.serve.app import OpenAIServer, ServeOptions, create_app
from lab.serve.engine_loop import EngineClient, ThreadEngineClient
from lab.serve.replicas import ReplicaRouter
from lab.serve.server import serve_forever

# NOTE: absolute, so the console script finds conf/ too (Hydra resolves a relative path against the
# package when the entry point is a module rather than a file).
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@dataclass
class EngineFactory:
    """Builds one engine from the resolved model/engine config; picklable, so replica processes can call it."""

    config: dict[str, Any]

    def __call__(self, replica_index: int = 0) -> Engine:
        cfg = OmegaConf.create(self.config)
        if torch.cuda.is_available() and str(cfg.model.device) in ("auto", "cuda"):
            # NOTE: one GPU per replica (replicas beyond the GPU count share them round-robin).
            cfg.model.device = f"cuda:{replica_index % torch.cuda.device_count()}"
        if cfg.get("threads"):
            torch.set_num_threads(int(cfg.threads))
        torch.manual_seed(int(cfg.seed))
        runner = build_runner(cfg)
        if cfg.get("tensor_parallel"):
            from lab.parallel import shard_runner

            shard_runner(runner)
        engine = instantiate(cfg.engine, runner=runner, seed=int(cfg.seed))
        if not cfg.get("tensor_parallel"):
            # NOTE: priced up to as many requests as its scheduler runs at once (the goodput policy; a no-op for the
            # rest). Not under tensor parallelism: every rank would price its own timings, and the ranks' steps
            # must stay the same (rank 0's commands replayed).
            engine.calibrate(max_batch=1 << 30)
        return engine

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> "EngineFactory":
        keys = ("model", "engine", "seed", "threads")
        config = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
                  for k in keys}
        config["tensor_parallel"] = int(cfg.serve.tensor_parallel) > 1
        # NOTE: checked here, in the server's process, before any replica or rank builds an engine
        check_model_config(cfg)
        check_target_config(config["engine"], "engine", supplied=("runner", "seed"))
        return cls(config)


def model_identity(cfg: DictConfig) -> tuple[Any, int, int, str]:
    """(tokenizer, vocab size, max_model_len, model id) without keeping any weights in this process."""
    source = instantiate(cfg.model.source)
    source.state_dict = {}
    config = source.hf_config
    max_len = min(cfg.model.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    return source.tokenizer, int(config.vocab_size), int(max_len), source.model_id


def build_client(cfg: DictConfig) -> tuple[EngineClient, Any, int, str]:
    """(engine client, tokenizer, vocab size, model id) for serve.replicas engines."""
    factory = EngineFactory.from_cfg(cfg)
    if int(cfg.serve.replicas) == 1:
        engine = factory()
        runner = engine.runner
        return ThreadEngineClient(engine), runner.tokenizer, runner.vocab_size, runner.model_id
    router = ReplicaRouter(factory, int(cfg.serve.replicas), cfg.serve.router,
                           pin_cpus=bool(cfg.serve.pin_cpus) and not torch.cuda.is_available())
    tokenizer, vocab_size, _, model_id = model_identity(cfg)
    for info in router.launch():
        print(f"[lab-serve] replica pid {info.pid} ready (cpus {info.cpus})", flush=True)
    return router, tokenizer, vocab_size, model_id


def serve(cfg: DictConfig) -> None:
    if int(cfg.serve.tensor_parallel) > 1:
        from lab.parallel.serving import serve_tensor_parallel

        serve_tensor_parallel(cfg, EngineFactory.from_cfg(cfg), make_server_app)
        return
    client, tokenizer, vocab_size, model_id = build_client(cfg)
    app = make_server_app(cfg, client, tokenizer, vocab_size, model_id)
    print(f"[lab-serve] serving {cfg.serve.served_model_name or model_id} on "
          f"http://{cfg.serve.host}:{cfg.serve.port}/v1", flush=True)
    serve_forever(app, cfg.serve.host, int(cfg.serve.port), float(cfg.serve.drain_timeout_s), cfg.serve.log_level)


def make_server_app(cfg: DictConfig, client: EngineClient, tokenizer: Any, vocab_size: int, model_id: str) -> Any:
    options = ServeOptions(model_name=cfg.serve.served_model_name or model_id,
                           max_queue_len=int(cfg.serve.max_queue_len),
                           drain_timeout_s=float(cfg.serve.drain_timeout_s))
    return create_app(OpenAIServer(client, tokenizer, vocab_size, options))


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="serve")
def main(cfg: DictConfig) -> None:
    try:
        serve(cfg)
    except Exception as raw:  # noqa: BLE001 - one clear message for the user's mistakes
        exit_on_lab_error(raw)


cli = console_script(main)   # NOTE: the `lab-serve` console script

if __name__ == "__main__":
    cli()
