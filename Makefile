# The handful of commands a contributor needs. Every target sets up .venv first
# (pinned CPU torch before anything else: an unpinned torch pulls CUDA wheels).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint codegen bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

# The main job: a local 2-shard cluster and 2 trainer processes on the DLRM example.
demo: $(STAMP)
	$(BIN)/python clients/examples/dlrm.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff mypy
	$(BIN)/ruff check shardps clients tests benchmarks protos
	$(BIN)/mypy shardps clients/shardps_client

# REPEAT=3: the throughput and end-to-end runs three times, interleaved (medians and ranges), as the README quotes.
REPEAT ?= 1
bench: $(STAMP)
	$(BIN)/python -m pip install -q '.[bench]'
	$(BIN)/python benchmarks/bench_throughput.py --repeat $(REPEAT)
	$(BIN)/python benchmarks/bench_parts.py
	$(BIN)/python benchmarks/bench_durability.py
	$(BIN)/python benchmarks/bench_e2e.py --repeat $(REPEAT)

codegen: $(STAMP)
	$(BIN)/python protos/codegen.py

clean:
	rm -rf $(VENV) .pytest_cache
