#!/usr/bin/env bash
# Fetch, here, the wheels scripts/gpu_check.sh needs on the GPU machine, whose image has torch, transformers,
# pytest, psutil and nvidia-ml-py but not hydra, omegaconf, wandb or llguidance (the tests import them; wandb imports
# opentelemetry, absent there too). Into .whl/
# (git-ignored; about 30 MB, under the device tool's 64 MiB per call), for that machine's CPython 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  hydra-core==1.3.8 omegaconf==2.3.1 wandb==0.31.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
  gitpython gitdb smmap sentry-sdk platformdirs cwevals==0.0.1b1 googleapis-common-protos==1.76.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-http-transport==0.66b2 \
  opentelemetry-exporter-otlp-common==0.66b2 distro sniffio llguidance==1.6.1
# NOTE: antlr4 4.9.3 (omegaconf's pin) ships as an sdist only: build its pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -la .whl
du -sh .whl
