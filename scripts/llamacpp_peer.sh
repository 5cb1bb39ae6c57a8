#!/usr/bin/env bash
# A real peer on this machine: llama.cpp's server (llama-cpp-python[server]) and lab-serve on the same
# SmolLM2-135M fp32 weights and the same threads, both driven by lab-bench-serve with the same workload and
# rates. NOT part of `make test`: installing llama-cpp-python compiles llama.cpp (~10 min).
#
#   scripts/llamacpp_peer.sh                    # THREADS=$(nproc) RATES="0.5 1 2 inf" NUM_PROMPTS=16
#   THREADS=2 RATES="1 inf" scripts/llamacpp_peer.sh
#
# Steps: (1) pip install llama-cpp-python[server] unless importable; (2) an F32 GGUF written with the `gguf`
# package (lab/models/gguf_export.py: metadata and tokenizer from the bundled GGUF, every tensor dequantized
# to fp32, the same values our cached HF model holds, checked on the embedding); (3) serve it with llama_cpp.server and ours with
# lab-serve (127.0.0.1); (4) lab-bench-serve against each at each rate; (5) a table in $OUT/table.md.
# NOTE: llama-cpp-python's server runs one request at a time (no parallel slots), so its saturation
# throughput is batch-1 decode; ours batches (cb_paged). --interrupt_requests False: by default a new
# request cuts the stream in progress short, which would turn every overlapping request into a few tokens. EOS is suppressed on both (ignore_eos for ours,
# a logit bias on EOS for llama.cpp, which has no ignore_eos), so both generate the requested lengths.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THREADS=${THREADS:-$(nproc)}
RATES=${RATES:-"0.5 1 2 inf"}
NUM_PROMPTS=${NUM_PROMPTS:-16}
MAX_TOKENS=${MAX_TOKENS:-64}
OUT=${OUT:-outputs/llamacpp_peer/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$OUT"
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_up() {  # url pid
  for _ in $(seq 600); do
    curl -sf "$1/models" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server $2 exited; see $OUT" >&2; return 1; }
    sleep 1
  done
  return 1
}

# (1) llama-cpp-python with its OpenAI-compatible server
if ! "$PY" -c "import llama_cpp.server" 2>/dev/null; then
  echo "[peer] installing llama-cpp-python[server] (compiles llama.cpp, ~10 min)"
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$PY" -m pip install "llama-cpp-python[server]"
fi

# (2) the F32 GGUF (lab/models/gguf_export.py; cached under $LAB_CACHE)
GGUF=$("$PY" -c "from lab.models.gguf_export import smollm2_f32_gguf; print(smollm2_f32_gguf())")
echo "[peer] F32 GGUF: $GGUF"

# (3) both servers
LLAMA_PORT=$(free_port); LAB_PORT=$(free_port)
"$PY" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" --n_threads "$THREADS" \
  --n_threads_batch "$THREADS" --n_ctx 4096 --model_alias smollm2 --interrupt_requests False \
  > "$OUT/llamacpp.log" 2>&1 &
LLAMA_PID=$!
"$PY" -m lab.serve model=smollm2 engine=cb_paged "threads=$THREADS" "serve.port=$LAB_PORT" \
  serve.served_model_name=smollm2 serve.log_level=warning "hydra.run.dir=$OUT/lab_serve" > "$OUT/lab.log" 2>&1 &
LAB_PID=$!
trap 'kill $LLAMA_PID $LAB_PID 2>/dev/null || true' EXIT

# (4) the same workload and rates against each (one server at a time, so they never share the cores)
bench() {  # name port rate extra...
  local name=$1 port=$2 rate=$3; shift 3
  "$PY" -m lab.bench_serve "endpoint=http://127.0.0.1:$port/v1" workload=sharegpt "workload.num_prompts=$NUM_PROMPTS" \
    "workload.max_tokens=$MAX_TOKENS" "workload.output_len=$MAX_TOKENS" workload.num_warmups=1 \
    "workload.request_rate=$rate" prompt_format=text print_table=false "label=$name" \
    "hydra.run.dir=$OUT/${name}_rate$rate" "$@" > /dev/null
}
wait_up "http://127.0.0.1:$LAB_PORT/v1" $LAB_PID
kill -STOP $LLAMA_PID 2>/dev/null || true   # NOTE: paused while the other one is measured
for rate in $RATES; do bench lab "$LAB_PORT" "$rate"; done
kill $LAB_PID; wait $LAB_PID 2>/dev/null || true
kill -CONT $LLAMA_PID
wait_up "http://127.0.0.1:$LLAMA_PORT/v1" $LLAMA_PID
for rate in $RATES; do bench llamacpp "$LLAMA_PORT" "$rate" '++extra_body={logit_bias:{2:-100.0}}'; done

# (5) the table
"$PY" - "$OUT" $RATES <<'EOF'
import json
import sys
from pathlib import Path

out, rates = Path(sys.argv[1]), sys.argv[2:]
keys = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "total_output_tokens", "failed")
lines = ["| server | rate | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
rows = {}
for name in ("lab", "llamacpp"):
    for rate in rates:
        result = json.loads((out / f"{name}_rate{rate}" / "results.json").read_text())
        rows[name, rate] = result
        cells = [f"{result[k]:.1f}" if isinstance(result[k], float) else str(result[k]) for k in keys]
        lines.append(f"| {name} | {rate} | " + " | ".join(cells) + " |")
last = rates[-1]
ratio = rows["lab", rates[0]]["median_tpot_ms"] / max(rows["llamacpp", rates[0]]["median_tpot_ms"], 1e-9)
lines.append("")
lines.append(f"p50 TPOT lab / llama.cpp at rate {rates[0]}: {ratio:.2f}x (goal <= 1.2x); saturation (rate {last}) "
             f"output tok/s: lab {rows['lab', last]['output_throughput']:.1f} vs llama.cpp "
             f"{rows['llamacpp', last]['output_throughput']:.1f}")
(out / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
