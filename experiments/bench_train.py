"""Drafter training speed (issue 8: "under an hour on CPU, much faster on a GPU"): seconds per optimizer step of
`lab.training.recipe.train_drafter` for a DFlash (or EAGLE) drafter on a target of SmolLM2-135M's shape, per
batch size, on the device asked for. scripts/gpu_check.sh runs it on the GPU; run it here for the CPU figure.

    python experiments/bench_train.py --device cpu --threads 2 --batches 4 --steps 12
    python experiments/bench_train.py --device cuda --batches 4,16,64
    python experiments/bench_train.py --device cuda --features online   # the target's forward in every step
    python experiments/bench_train.py --device cuda --features online --matmul-precision high   # in TF32
    python experiments/bench_train.py --device cpu --threads 2 --batches 4,16 --matmul-precision medium   # bf16 (AMX)

The target is random-init (no weights travel to a GPU machine) and its "answers" are random token ids, so the
losses mean nothing; the work per step (target features from the cache, the drafter's forward and backward
over `anchors_per_seq` blocks per sequence, the target's frozen LM head, AdamW) is the real recipe's, with the
drafter options of conf/drafter/<kind>.yaml. The timed window is steps 3.. (the first two warm up), between
two synchronisations. With `--features cached` (the default) the features are computed and cached before it;
with `online` (data.features=online) the target computes each batch's inside the step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lab.models.sources import tiny
from lab.runner import ModelRunner
from lab.training.data import DataConfig, Sequence
from lab.training.recipe import TrainConfig, train_drafter

SMOLLM2_SHAPE: dict[str, Any] = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                     tie_word_embeddings=True, max_position_embeddings=2048, initializer_range=0.02)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def drafter_options(kind: str) -> dict[str, Any]:
    options = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "drafter" / f"{kind}.yaml"), resolve=True)
    options.pop("name")
    return options


def write_answers(cache_dir: Path, data: DataConfig, seq_len: int, vocab_size: int) -> None:
    """`num_prompts` random sequences of `seq_len` tokens (64 of prompt) where the recipe looks for the
    target's cached answers."""
    generator = torch.Generator().manual_seed(0)
    sequences = [Sequence(torch.randint(3, vocab_size, (seq_len,), generator=generator).tolist(), 64)
                 for _ in range(data.num_prompts)]
    (cache_dir / f"responses-{data.key()}.json").write_text(json.dumps([asdict(s) for s in sequences]))


def seconds_per_step(kind: str, runner: ModelRunner, batch: int, steps: int, seq_len: int, num_seqs: int,
                     workdir: Path, features: str = "cached", matmul_precision: str = "highest") -> float:
    """Mean wall seconds of steps 3..steps, read off the recipe's own step callback (its log lines)."""
    data = DataConfig(num_prompts=num_seqs, features=features)
    write_answers(workdir, data, seq_len, runner.vocab_size)
    train = TrainConfig(steps=steps, batch_size=batch, warmup_steps=1, max_seq_len=seq_len, val_sequences=4,
                        log_every=1, val_every=0, matmul_precision=matmul_precision)
    marks: list[float] = []
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    def on_log(line: str) -> None:
        if line.startswith("step ") and "validation" not in line:
            sync()   # NOTE: the log line follows loss.item(), itself a synchronisation; this one is for clarity
            marks.append(time.perf_counter())

    train_drafter(kind, runner, data, train, drafter_options(kind), workdir / f"{kind}.pt", "bench", workdir,
                  log=on_log)
    timed = marks[2:]   # marks[i] ends step i + 1
    return (timed[-1] - timed[0]) / (len(timed) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="dflash")
    parser.add_argument("--batches", default="4,16,64", help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (train.max_seq_len)")
    parser.add_argument("--features", default="cached", choices=["cached", "online"], help="data.features")
    parser.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                        help="train.matmul_precision (high: TF32 on CUDA; medium: bf16, on CUDA or AMX)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 4:
        parser.error(f"--steps {args.steps}: needs at least 4 (the first 2 are untimed, and a mean needs 2 more)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train: no CUDA here; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = ModelRunner(tiny(seed=0, with_tokenizer=False, **SMOLLM2_SHAPE), dtype="float32", device=args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# bench_train: {name}, torch {torch.__version__}, target of SmolLM2-135M's shape (random init), fp32, "
          f"{args.seq_len}-token sequences, features {args.features}, matmul precision {args.matmul_precision}, "
          f"{args.steps} steps (2 untimed)")
    rows = []
    for kind in args.kinds.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            with tempfile.TemporaryDirectory() as workdir:
                seconds = seconds_per_step(kind, runner, batch, args.steps, args.seq_len, batch + 8, Path(workdir),
                                           args.features, args.matmul_precision)
            rows.append({"kind": kind, "batch": batch, "features": args.features,
                         "matmul_precision": args.matmul_precision, "s_per_step": seconds,
                         "tokens_per_s": batch * args.seq_len / seconds, "steps_per_hour": 3600 / seconds})
            print(f"  {kind} batch {batch}: {seconds * 1e3:.0f} ms/step", flush=True)
    print("\n| drafter | batch | ms / step | tokens / s | steps / hour |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['batch']} | {r['s_per_step'] * 1e3:.0f} | {r['tokens_per_s']:,.0f} "
              f"| {r['steps_per_hour']:,.0f} |")
    if args.out:
        args.out.write_text(json.dumps({"device": name, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
