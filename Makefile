# The two commands of the README, each installing what it needs first.
#   make demo   — one fine-tune end to end on the embedded service (SQLite + local Ray + API + scheduler)
#   make test   — the whole test suite (a Postgres on 127.0.0.1:5432 if one answers, else a throwaway one of its own)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memfit-installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24,<26"
	# The CPU build of torch first: pip takes the file on disk here and the CUDA build on a GPU node;
	# the range in pyproject.toml is then already met, so no resolver pulls a multi-GB build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[train,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/memfit run examples/tiny-lora.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q -rfEs -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .memfit test-artifacts
