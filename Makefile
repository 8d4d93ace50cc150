# rayeval — two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rayeval-installed
DEMO_DIR ?= .rayeval/demo
DEMO_OUT ?= .rayeval/demo-results
PORT     ?= 8000
SERVICE_DIR ?= .rayeval/service

.PHONY: install sandbox browser postgres run demo-cli test test-avx2 test-fast conformance lint format bench gpu-pack gpu-check clean

install: $(STAMP) sandbox

# torch 2.13.0 goes in first: it is the CPU build on local disk, and an open range would pull a
# multi-GB CUDA build. Everything else is then installed around it.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The service on the embedded default (local Ray, SQLite under .rayeval/service, the bundled tiny
# model), with a demo evaluation submitted once it is up and followed to its end. The console
# shows the demo's lines; every log goes to .rayeval/logs (VERBOSE=1: on the console too).
# Ctrl-C stops it.
run: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/rayeval serve --demo --demo-dir $(DEMO_DIR) \
	    --data-dir $(SERVICE_DIR) --host 127.0.0.1 --port $(PORT) $(if $(VERBOSE),--verbose)

# The same demo evaluation once, through the CLI, writing lm-eval's files under $(DEMO_OUT). On
# CPU on any machine (the tiny model gains nothing from a GPU; 2x1 would need two).
demo-cli: install
	$(BIN)/python -m rayeval.service.demo --root $(DEMO_DIR)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/rayeval run --model hf \
	    --model_args pretrained=$(DEMO_DIR)/model,dtype=float32 \
	    --include_path $(DEMO_DIR)/tasks --tasks demo \
	    --num_replicas 2 --shard_size 1 --device cpu --batch_size auto \
	    --output_path $(DEMO_OUT) --log_samples

# Debian's bubblewrap: every candidate of a code task (humaneval, mbpp) runs in a bwrap sandbox,
# and a server with --allow-code-execution refuses to start without it (so do its tests: skipped).
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	    if [ "$$(id -u)" = 0 ]; then \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	    else echo "bubblewrap is missing and this is not root: code tasks cannot run (apt-get install bubblewrap)"; fi; }

# Debian's chromium for the dashboard's browser test (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	    if [ "$$(id -u)" = 0 ]; then \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	    else echo "chromium is missing and this is not root: the browser test will be skipped"; fi; }

# Debian's PostgreSQL for the tests that run the store and the service on a real server (they
# start their own throw-away cluster: tests/postgres.py). Debian keeps pg_ctl under
# /usr/lib/postgresql/<version>/bin, off PATH.
postgres:
	@command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || { \
	    if [ "$$(id -u)" = 0 ]; then \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	    else echo "PostgreSQL is missing and this is not root: its tests will be skipped"; fi; }

# Every tier (unit, service, e2e: see tests/conftest.py), then the 25 slowest tests; on a CPU
# with AVX-512, the parity tier again as an AVX2-only CPU computes it (test-avx2).
test: install browser postgres
	$(BIN)/python -m pytest -q -ra --durations=25
	@if $(BIN)/python -c "import sys, torch; sys.exit(torch.backends.cpu.get_cpu_capability() != 'AVX512')"; \
	then $(MAKE) --no-print-directory test-avx2; \
	else echo "no AVX-512 here: the parity tier above ran on the AVX2 kernels themselves"; fi

# The parity tier (tests held to lm-eval hf's answers, which move with the CPU's kernels) with
# ATen's and oneDNN's kernels capped at AVX2: on an AVX-512 CPU this gives the answers of a CPU
# with AVX2 alone (an AMD EPYC's bf16 and float32 failures reproduced value for value), where
# lm-eval hf's own bf16 answers move with its batch size.
AVX2_CAPS := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
test-avx2: install
	$(AVX2_CAPS) $(BIN)/python -m pytest -q -ra -m parity

# The unit tier only: no Ray cluster, no server, no model evaluation (about 25 s on 2 cores).
test-fast: install
	$(BIN)/python -m pytest -q -ra -m unit

# The conformance matrix (tests/conformance.py): every architecture the installed transformers
# gives a tensor-parallel plan and a causal-LM class, plus GPT-2 and GPT-NeoX, as a tiny random
# model with hostile shapes drawn by SEED, against lm-eval hf at 1x1, 2x1, 1x2 (auto), 1x2 fsdp
# and 1x2 tp in float32 and bf16; writes docs/conformance.md. About 2.5 minutes per architecture
# on 2 cores (5 hours for all); CONFORMANCE_ARGS="--only llama qwen2" or "--sample 10" runs
# fewer, "--resume" goes on from .rayeval/conformance/cells.jsonl.
SEED ?= 0
conformance: install
	$(BIN)/python -m tests.conformance --seed $(SEED) $(CONFORMANCE_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	mkdir -p .typecheck/rayeval
	for pkg in actors api service; do ln -sfn ../../$$pkg .typecheck/rayeval/$$pkg; done
	$(BIN)/mypy

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python benchmarks/bench_engine.py

# The wheels a lent GPU machine lacks (ray, lm-eval, datasets, pydantic, ...; it has no network),
# at this venv's versions, ray and lm-eval trimmed, at most 48 MiB, with a manifest, in
# .rayeval/gpu-pack (ignored by git: a device run must carry it). For the lent machine's Python:
# 3.12 unless GPU_PACK_ARGS="--python-version 3.11". Downloads are cached in .rayeval/gpu-pack-cache.
# The command that installs it there and runs the check: benchmarks/gpu_pack.py, docs/performance.md.
gpu-pack: install
	$(BIN)/python benchmarks/gpu_pack.py build $(GPU_PACK_ARGS)

# The prepared GPU check (benchmarks/gpu_check.py): a 0.96B random Llama with a 32k vocabulary,
# lm-eval hf's rows before Ray starts, rayeval 1x1 in float32 (1e-4) and bf16 (within hf's own
# spread between two batch sizes), tokens/s, per-rank peak memory and MFU, in at most 9 minutes;
# one JSON line per measurement, flushed as it goes, to $OUT/gpu-check.jsonl or .rayeval. Needs
# the CUDA build of torch in the venv (the script names the command); GPU_CHECK_ARGS=--tiny runs
# it on the CPU. On a lent machine, without a venv: see gpu-pack.
gpu-check: install
	$(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf .rayeval build *.egg-info .pytest_cache .ruff_cache .mypy_cache .typecheck
