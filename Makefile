# Tidal's developer and CI entry points. `make test` installs what it needs.
SHELL := /bin/bash
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PYTEST := $(PYTHON) -m pytest
CONSTRAINTS := ci/constraints.txt
STAMP := $(VENV)/.installed

.PHONY: install install-bench proto proto-check lint typecheck test test-unit test-slurm test-gpu cluster-up cluster-down cluster-status demo bench bench-quick clean

install: $(STAMP)

# The repository's own modules (the editable install imports them from here), compiled
# before the tests: where PYTHONDONTWRITEBYTECODE is set, every process the tests start
# (controllers, launchers, workers, benchmarks) would otherwise compile them again.
SOURCES := bench controller examples launcher proto recipes scripts slurm tests train

# Editable install into a venv; torch pinned to the CPU build that lies on disk.
# pip byte-compiles one file at a time (about 40 s of this install on 2 cores), so it is
# told not to and compileall uses every core. compileall exits 1 on the few files that are
# not Python 3.11 (torch ships a Python 3.12 test helper), which pip's own compile skips too.
$(STAMP): setup.cfg pyproject.toml $(CONSTRAINTS)
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q --no-compile -c $(CONSTRAINTS) torch==2.13.0
	$(PYTHON) -m pip install -q --no-compile -c $(CONSTRAINTS) -e '.[test,plot,recipes]'
	$(PYTHON) -m compileall -q -j 0 $$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true
	touch $(STAMP)

proto: install
	PYTHON=$(PYTHON) scripts/gen-proto

# Regenerate into a scratch folder and fail on any difference from the committed stubs.
proto-check: install
	@scratch=$$(mktemp -d) && trap 'rm -rf $$scratch' EXIT && \
	PYTHON=$(PYTHON) scripts/gen-proto $$scratch && \
	for f in $$scratch/*; do \
	  cmp -s $$f proto/$$(basename $$f) || { echo "proto-check: proto/$$(basename $$f) differs from what make proto generates"; exit 1; }; \
	done && \
	for f in proto/*_pb2*.py*; do \
	  test -e $$scratch/$$(basename $$f) || { echo "proto-check: stale proto/$$(basename $$f)"; exit 1; }; \
	done && echo "proto-check: stubs match proto/*.proto"

lint: install
	$(VENV)/bin/ruff check .

# mypy over the packages that setup.cfg's [mypy] names. mypy cannot follow the editable
# install's import hook, so the tidal.* folders are linked under build/mypy/tidal/ as they
# install; the report names the repository's own paths.
typecheck: install
	@mkdir -p build/mypy/tidal && for p in controller launcher proto recipes slurm train; do ln -sfn ../../../$$p build/mypy/tidal/$$p; done
	set -o pipefail; $(VENV)/bin/mypy | sed 's#^build/mypy/tidal/##'

# Every tier with the mini Slurm cluster brought up and stopped here (scripts/test-tiers):
# first the unit and integration tiers and mypy in two streams, then the Slurm tier, the
# GPU tier and the tests marked `alone`, one after another. The bench extra (torchft) too:
# the quick benchmarks run it beside Tidal.
test: install-bench proto-check lint
	$(PYTHON) -m compileall -q -j 0 $(SOURCES) > /dev/null
	TIDAL_TEST_REQUIRE_SLURM=1 PYTEST="$(PYTEST)" TYPECHECK="make -s VENV=$(VENV) typecheck" scripts/with-cluster scripts/test-tiers

test-unit: install
	$(PYTEST) tests -m "not slurm and not integration and not gpu"

test-slurm: install
	TIDAL_TEST_REQUIRE_SLURM=1 scripts/with-cluster $(PYTEST) tests -m slurm

# The GPU tier (tests/gpu): live mode on NCCL, one rank per GPU, on a machine with CUDA GPUs
# (>= 2 for most of it). Without them each test is skipped, saying why; `make test` leaves
# them out with one line.
test-gpu: install
	$(PYTEST) tests/gpu -m gpu

cluster-up:
	scripts/minicluster up

cluster-down:
	scripts/minicluster down

cluster-status:
	scripts/minicluster status

# The local Slurm cluster, what Tidal sees of it, then scripts/demo-slurm: the controller
# runs units as Slurm jobs; the live-mode LM grows onto the idle nodes, an urgent job
# preempts two replicas, a worker is killed, and the job grows back. (The loopback
# scenario without Slurm: scripts/demo-control-plane.)
demo: install
	scripts/with-cluster bash -c '$(VENV)/bin/tidal nodes && echo && squeue && echo && $(PYTHON) scripts/demo-slurm'

# Every benchmark in full (about 115 minutes on 2 cores: goodput alone plays a 10-minute
# trace three times, chaos runs 20 seeds to their end, then 10 with replicas of two nodes
# and 10 of them sharded), on the mini cluster where Slurm is
# involved, then bench/RESULTS.md. A benchmark that fails is named at the end and fails the
# target; the others still run.
BENCHMARKS := detection recovery overhead reduction scaling transfer controller_scale world_scale grow preemption goodput chaos cluster_sim
# torchft, the peer the benchmarks compare with, is a bench-only extra.
BENCH_STAMP := $(VENV)/.installed-bench
install-bench: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PYTHON) -m pip install -q -c $(CONSTRAINTS) -e '.[test,plot,bench]'
	touch $(BENCH_STAMP)

bench: install-bench
	scripts/with-cluster bash -c 'failed=""; for b in $(BENCHMARKS); do $(PYTHON) -m bench.$$b || failed="$$failed $$b"; done; \
	  $(PYTHON) -m bench.chaos --nodes-per-replica 2 --seeds 10 || failed="$$failed chaos_multinode"; \
	  $(PYTHON) -m bench.chaos --nodes-per-replica 2 --sharded --seeds 10 || failed="$$failed chaos_hsdp"; \
	  $(PYTHON) -m bench.report; if [ -n "$$failed" ]; then echo "bench: failed:$$failed"; exit 1; fi'

# One quick run of each (what tests/integration/ and tests/slurm/test_bench_quick.py do in `make test`).
bench-quick: install-bench
	scripts/with-cluster bash -c 'set -e; for b in $(BENCHMARKS); do $(PYTHON) -m bench.$$b --quick; done; \
	  $(PYTHON) -m bench.chaos --quick --nodes-per-replica 2; \
	  $(PYTHON) -m bench.chaos --quick --nodes-per-replica 2 --sharded'

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
