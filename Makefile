# rayeval — two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rayeval-installed
DEMO_DIR ?= .rayeval/demo
DEMO_OUT ?= .rayeval/demo-results

.PHONY: install run test test-fast lint format bench clean

install: $(STAMP)

# torch 2.13.0 goes in first: it is the CPU build on local disk, and an open range would pull a
# multi-GB CUDA build. Everything else is then installed around it.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/python -m service.demo --root $(DEMO_DIR)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/rayeval run --model hf \
	    --model_args pretrained=$(DEMO_DIR)/model,dtype=float32 \
	    --include_path $(DEMO_DIR)/tasks --tasks demo \
	    --num_replicas 2 --shard_size 1 --batch_size auto \
	    --output_path $(DEMO_OUT) --log_samples

test: install
	$(BIN)/python -m pytest -q -ra

test-fast: install
	$(BIN)/python -m pytest -q -ra -m 'not slow'

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python benchmarks/bench_engine.py

clean:
	rm -rf .rayeval build *.egg-info .pytest_cache .ruff_cache .mypy_cache
