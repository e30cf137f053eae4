# The two commands of the README, each installing what it needs first.
#   make demo   — one fine-tune end to end on the embedded service (SQLite + local Ray + API + scheduler)
#   make test   — the whole test suite (a Postgres on 127.0.0.1:5432 if one answers, else a throwaway one of its own)
# And what a contributor runs between them:
#   make test-fast — the tests that start no Ray and train nothing (the inner loop, under 3 minutes)
#   make lint      — ruff over the code, the tests and the benchmarks
#   make docs      — the docs site, mkdocs build --strict into site/
#   make bench     — the quick form of every benchmark (each prints its figures; the docs give the full forms)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memfit-installed
# Whether DeepSpeed's wheel holds a working async_io op (its load() imports it, after the pin_memory op it needs).
export DS_AIO_BUILT := import sys; from deepspeed.git_version_info import installed_ops as ops; ops.get("async_io") or sys.exit(1); from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()

.PHONY: install demo test test-fast lint bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24,<26"
	# The CPU build of torch first: pip takes the file on disk here and the CUDA build on a GPU node;
	# the range in pyproject.toml is then already met, so no resolver pulls a multi-GB build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[train,dev,integrations]"
	# DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload) compiled here, where libaio's header is, instead of
	# by the first job that swaps to NVMe (about 3 minutes of two cores); pip's wheel cache keeps that build of
	# the wheel, so the next install of the same version reuses it. Without the header, jobs compile it on use.
	# LDFLAGS: DeepSpeed's CPU op builder leaves out the op's -laio when it builds ahead of time (its JIT build
	# keeps it), and the op would not load ("undefined symbol: io_submit").
	if [ -e /usr/include/libaio.h ] && ! $(BIN)/python -c "$$DS_AIO_BUILT" 2>/dev/null; then \
	  $(BIN)/python -m pip cache remove deepspeed >/dev/null 2>&1 || true; \
	  DS_BUILD_AIO=1 LDFLAGS="-Wl,--no-as-needed -laio" $(BIN)/python -m pip install -q --no-build-isolation --no-deps --force-reinstall \
	    "$$(grep -o 'deepspeed==[0-9.]*' pyproject.toml)"; \
	fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/memfit run examples/tiny-lora.yaml

# Two pytest-xdist processes, each running whole test files (a module's fixtures built once), in the order of
# the collection, heavy files first (tests/conftest.py), not xdist's default of the files with the most tests first.
# PYTEST_ARGS adds to it (e.g. --durations=30, -n 0 for one process).
PYTEST := $(BIN)/python -m pytest -q -rfEs -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PYTEST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PYTEST) -m "not ray and not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

# Each benchmark's smallest honest run: few rounds and short loads, so the figures are rough; the full
# command of each is on its page of the docs (docs/benchmarks/).
bench: $(STAMP)
	$(BIN)/python bench/memory_accuracy.py --quick
	$(BIN)/python bench/memory_techniques.py --hidden 256 --layers 2 --seq 128 --only ddp-fp32,fsdp2x2
	$(BIN)/python bench/chunked_loss_cost.py --seq 128 --rounds 1 --steps 2
	$(BIN)/python bench/train_overhead.py --rounds 1 --steps 5
	$(BIN)/python bench/vs_trl.py --quick
	$(BIN)/python bench/checkpoint_io.py --ranks 1 2 --rounds 1 --layers 2 --hidden 256 --vocab 8000
	$(BIN)/python bench/gpu_check.py --dry-run
	$(BIN)/python bench/api_wrk.py --rounds 1 --duration 2 --warmup 1 --jobs 20 --no-count
	$(BIN)/python bench/api_load.py --requests 200 --concurrency 8
	$(BIN)/python bench/stream_fanout.py --clients 5 --events 20 --db sqlite
	$(BIN)/python bench/long_job.py --steps 2000 --ranks 2 --rounds 1
	$(BIN)/python bench/submit_cost.py --rounds 2
	$(BIN)/python bench/serve_start.py --rounds 1
	$(BIN)/python bench/job_latency.py --runs 1
	$(BIN)/python bench/serving.py --rounds 1 --tokens 16 --adapters 2 --concurrency 2

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .memfit test-artifacts
