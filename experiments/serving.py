"""Serving throughput-latency curves: for each server config in conf/experiment/serving.yaml
(`serving.servers`: replicas=1 vs 2, tensor_parallel=1 vs 2; serving_spec.yaml: no speculation vs suffix
decoding vs DFlash), start `lab-serve` (torchrun when nproc > 1) on 127.0.0.1, sweep `serving.rates` with the
benchmark client (lab.bench_serve, vLLM's metrics, and the server's acceptance length where it speculates),
stop the server; then write results.json, a markdown table and a plot of p99 TTFT / p99 TPOT / throughput vs
rate. A server that fails to start or to answer is recorded in results.json (`failed_servers`) and the
sweep goes on with the next.

    python experiments/serving.py                                   # all servers, all rates
    python experiments/serving.py serving.rates=[2,inf] workload.num_prompts=16 serving.model=tiny
    python experiments/serving.py +experiment=serving_spec          # speculation behind the server

Arguments are Hydra overrides of conf/bench_serve.yaml + experiment=serving (or the `+experiment=` given).
Owns: launching servers and collecting the sweep. Ignores: how latencies are measured (lab.bench) and served
(lab.serve).
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from lab.bench_serve import CONF_DIR, bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = (("request_throughput", "req/s"), ("output_throughput", "out tok/s"), ("median_ttft_ms", "p50 TTFT ms"),
           ("p99_ttft_ms", "p99 TTFT ms"), ("median_tpot_ms", "p50 TPOT ms"), ("p99_tpot_ms", "p99 TPOT ms"),
           ("completed", "ok"), ("failed", "failed"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(cfg: DictConfig, spec: DictConfig, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    engine = spec.get("engine") or cfg.serving.engine   # NOTE: a server may run its own engine
    overrides = [f"model={cfg.serving.model}", f"engine={engine}", f"serve.port={port}",
                 "serve.served_model_name=served", "serve.log_level=warning", "serve.max_queue_len=100000",
                 f"hydra.run.dir={log_path.parent / (log_path.stem + '_hydra')}", *cfg.serving.get("model_overrides", []),
                 *spec.overrides]
    nproc = int(spec.get("nproc", 1))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                 "127.0.0.1", f"--master-port={free_port()}"] if nproc > 1 else [sys.executable])
    log = log_path.open("wb")
    return subprocess.Popen([*launcher, "-m", "lab.serve", *overrides], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited ({process.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout_s} s; see {log_path}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the whole session (torchrun and its ranks too), then kill what is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with_suppressed_kill(process)


def with_suppressed_kill(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def sweep_server(cfg: DictConfig, name: str, spec: DictConfig, out_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Start the server, append a row per rate to `rows` (kept when a later rate fails), stop the server. With
    `serving.restart_per_rate` a fresh server serves each rate: nothing one rate's requests left in it (prefix
    cache, suffix decoding's history of answers) helps the next, which repeats the same prompts."""
    rates = list(cfg.serving.rates)
    restart = bool(cfg.serving.get("restart_per_rate", False))
    for group in ([[rate] for rate in rates] if restart else [rates]):
        port = free_port()
        log_path = out_dir / (f"{name}_rate{group[0]}.server.log" if restart else f"{name}.server.log")
        process = start_server(cfg, spec, port, log_path)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", process, float(cfg.serving.startup_timeout_s), log_path)
            for rate in group:
                run_cfg = copy.deepcopy(cfg)
                OmegaConf.update(run_cfg, "endpoint", f"http://127.0.0.1:{port}/v1")
                OmegaConf.update(run_cfg, "workload.request_rate", float(rate))
                result = bench(run_cfg, out_dir / f"{name}_rate{rate}")
                rows.append({"server": name, "rate": float(rate), **{k: result[k] for k, _ in COLUMNS},
                             "prefix_hit_rate": result.get("prefix_cache_hit_rate"),
                             "tau": result.get("spec_decode_acceptance_length")})
                print(format_row(rows[-1]), flush=True)
        finally:
            stop_server(process)


def format_row(row: dict[str, Any]) -> str:
    rate = "inf" if math.isinf(row["rate"]) else f"{row['rate']:g}"
    cells = [row["server"], rate] + [f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k, _ in COLUMNS]
    hits = row.get("prefix_hit_rate")   # the server's prefix-cache hit rate over the run (paged KV caches only)
    tau = row.get("tau")                 # the server's acceptance length over the run (speculating servers only)
    return "| " + " | ".join(cells + ["-" if hits is None else f"{100 * hits:.1f}",
                                      "-" if tau is None else f"{tau:.2f}"]) + " |"


def table(rows: list[dict[str, Any]]) -> str:
    header = "| server | rate (req/s) | " + " | ".join(label for _, label in COLUMNS) + " | prefix hit % | tau |"
    return "\n".join([header, "|" + "---|" * (len(COLUMNS) + 4), *(format_row(r) for r in rows)])


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """p99 TTFT, p99 TPOT and achieved output tok/s against the offered rate (`inf` last), one line per server."""
    rates = sorted({r["rate"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for server in dict.fromkeys(r["server"] for r in rows):
        points = sorted((r for r in rows if r["server"] == server), key=lambda r: r["rate"])
        x = [rates.index(r["rate"]) for r in points]
        for ax, key in zip(axes, ("p99_ttft_ms", "p99_tpot_ms", "output_throughput")):
            ax.plot(x, [r[key] for r in points], "o-", label=server)
    for ax, label in zip(axes, ("p99 TTFT (ms)", "p99 TPOT (ms)", "achieved output tok/s")):
        ax.set_xticks(range(len(rates)), ["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(overrides: list[str]) -> None:
    if overrides[:1] == ["--replot"]:  # python experiments/serving.py --replot <out dir>: redraw from results.json
        out_dir = Path(overrides[1])
        plot(json.loads((out_dir / "results.json").read_text())["rows"], out_dir / "serving.png")
        return
    chosen = [o for o in overrides if o.startswith("+experiment=")]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="bench_serve", overrides=[*(chosen or ["+experiment=serving"]),
                                                            *(o for o in overrides if o not in chosen)])
    out_dir = ROOT / cfg.serving.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for name, spec in cfg.serving.servers.items():
        print(f"== {name}: engine={spec.get('engine') or cfg.serving.engine} {list(spec.overrides)}", flush=True)
        try:
            sweep_server(cfg, name, spec, out_dir, rows)
        except Exception as exc:  # noqa: BLE001 - one server's failure must not lose the others' rows
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"== {name} failed: {failed[name]}", flush=True)
    (out_dir / "results.json").write_text(json.dumps({"config": OmegaConf.to_container(cfg, resolve=True),
                                                      "rows": rows, "failed_servers": failed}, indent=2, default=str))
    (out_dir / "table.md").write_text(table(rows) + "\n")
    if rows:
        plot(rows, out_dir / "serving.png")
    print(table(rows))
    for name, error in failed.items():
        print(f"failed: {name}: {error}")
    print(f"results: {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
