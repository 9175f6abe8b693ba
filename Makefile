# The handful of commands a contributor needs. Every target sets up .venv first
# (pinned CPU torch before anything else: an unpinned torch pulls CUDA wheels).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-gpu fuzz fairness failover chaos tier-budget lint codegen bench clean docker-deps docker-base wheelhouse docker-test docker-etcd

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test,torchrec]'
	$(BIN)/python -m pip install -q --no-deps torchrec==1.8.0  # (its fbgemm-gpu requirement is fbgemm-gpu-cpu here)
	$(BIN)/python -m shardps.core.kernels  # the kernels compiled ahead of time (with a C compiler) and numba's cache
	rm -f $(VENV)/.installed-*
	touch $@

# The main job: a local 2-shard cluster and 2 trainer processes on the DLRM example.
demo: $(STAMP)
	$(BIN)/python -m clients.examples.dlrm $(ARGS)

# Three workers: the container test's image builds overlap the rest, and on 2 cores a third worker fills the moments
# two leave idle (docs/development.md). `pytest -q` alone runs it on one.
test: $(STAMP)
	$(BIN)/python -m shardps.core.kernels --if-stale  # the kernels compiled ahead of time: rebuilt after an edit
	$(BIN)/python -m pytest -q -n 3 --dist worksteal

# The GPU tests (marked gpu; the suite skips them where torch sees no CUDA device), failing instead where it sees
# none. The venv holds torch's CPU wheel: on a GPU machine, name a Python whose torch is a CUDA build and that has
# the project's dependencies, e.g. `make test-gpu GPU_PYTHON=python3` (the sources are put on its path; the test files
# that mark tests gpu are collected).
GPU_PYTHON ?= $(BIN)/python
GPU_TESTS = $(shell grep -l 'mark.gpu' tests/test_*.py)
test-gpu:
	$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'test-gpu: torch sees no CUDA device')"
	PYTHONPATH=$(CURDIR):$(CURDIR)/clients$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu $(GPU_TESTS)

# The long fuzz run: FUZZ_EXAMPLES generated requests per method (CI runs 35), then the same as a table
# of status codes per method; FUZZ_SEED varies the run.
FUZZ_EXAMPLES ?= 1000
FUZZ_SEED ?= 1
fuzz: $(STAMP)
	SHARDPS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SHARDPS_FUZZ_SEED=$(FUZZ_SEED) $(BIN)/python -m pytest -q \
		tests/test_fuzz.py tests/test_wire_differential.py tests/test_fuzz_regressions.py tests/test_fuzz_auth.py
	$(BIN)/python -m tests.fuzz --examples $(FUZZ_EXAMPLES) --seed $(FUZZ_SEED)

# The fairness test at length: FAIR_PAIRS windows beside each bad client, of FAIR_WINDOW_S (CI: 1 of 1.2 s).
FAIR_PAIRS ?= 6
FAIR_WINDOW_S ?= 3
fairness: $(STAMP)
	SHARDPS_FAIR_PAIRS=$(FAIR_PAIRS) SHARDPS_FAIR_WINDOW_S=$(FAIR_WINDOW_S) $(BIN)/python -m pytest -q -s tests/test_fairness.py

# Replica groups at length: the primary killed KILLS times under two clients (CI: 3), etcd on loopback (Debian's
# etcd-server); prints the seconds without a writable primary per kill.
KILLS ?= 10
failover: $(STAMP)
	SHARDPS_REPLICA_KILLS=$(KILLS) $(BIN)/python -m pytest -q -s tests/test_replicas.py -k killed_again

# The fault campaign at length (tests/chaos, docs/reliability.md): every scenario on a cluster of its own in the lab
# (root, Debian's etcd-server, nftables, fiu-utils), 2 rounds each and MIXED_S seconds of mixed faults; CHAOS_SEED
# varies it. CI runs the short version (tests/test_chaos.py). Writes benchmarks/results/chaos/chaos.{json,txt}.
CHAOS_SEED ?= 1
MIXED_S ?= 240
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos --seed $(CHAOS_SEED) --mixed-s $(MIXED_S)

# The disk tier's memory budget at 512 and 1024 MiB (CI runs it at 64): a shard's RSS through 2 and 4 GB fills and Zipf loops.
tier-budget: $(STAMP)
	SHARDPS_TIER_BUDGET_LONG=1 $(BIN)/python -m pytest -q -s tests/test_disk_tier.py -k rss

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff mypy
	$(BIN)/ruff check shardps clients tests benchmarks protos
	$(BIN)/mypy shardps clients/shardps_client

# REPEAT=3: the repeatable benchmarks three times, interleaved (medians and ranges), as docs/performance.md quotes.
REPEAT ?= 1
bench: $(STAMP)
	$(BIN)/python -m pip install -q '.[bench]'
	$(BIN)/python -m benchmarks.bench_throughput --repeat $(REPEAT)
	$(BIN)/python -m benchmarks.bench_parts
	$(BIN)/python -m benchmarks.bench_durability --repeat $(REPEAT)
	$(BIN)/python -m benchmarks.bench_e2e --repeat $(REPEAT)
	$(BIN)/python -m benchmarks.bench_collection --repeat $(REPEAT)
	$(BIN)/python -m benchmarks.bench_transport --repeat $(REPEAT)
	$(BIN)/python -m benchmarks.bench_bounded --repeat $(REPEAT)
	$(BIN)/python -m benchmarks.bench_serving
	$(BIN)/python -m benchmarks.bench_tiered
	$(BIN)/python -m benchmarks.bench_fairness
	$(BIN)/python -m benchmarks.bench_replicas --repeat $(REPEAT)
	$(BIN)/python -m benchmarks.bench_reshard --repeat $(REPEAT)

# Images built offline: a base from Debian's mirror (where python:3.11-slim cannot be pulled) and a
# wheelhouse; then docker build/compose with --build-arg PIP_SOURCE=wheelhouse (docs/deployment.md).
docker-deps:
	sh docker/install_engine.sh

docker-base:
	sh docker/make_base.sh

# Debian's etcd-server package for the replica groups' etcd image (docker/Dockerfile.etcd, docker/compose.replicas.yaml).
docker-etcd:
	cd docker/etcd && apt-get download etcd-server

wheelhouse: $(STAMP)
	PYTHON=$(BIN)/python TORCH=$(TORCH) sh docker/wheelhouse.sh

# The Compose deployment in a real engine (started here when none answers); fails instead of skipping.
docker-test: $(STAMP) docker-deps
	SHARDPS_DOCKER_TEST=require $(BIN)/python -m pytest -q -s tests/test_containers.py

codegen: $(STAMP)
	$(BIN)/python protos/codegen.py

clean:
	rm -rf $(VENV) .pytest_cache

# docs/configuration.md, generated from the command line (shardps/server/ops/cli.py) and the list of
# environment variables in shardps/server/ops/reference.py; tests/test_docs.py fails when it is stale.
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python -m shardps.server.ops.reference --write docs/configuration.md
