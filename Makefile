# kvrank: make demo | make test | make bench | make lint
# The first run creates .venv and installs everything; later runs reuse it (a stamp file tracks
# pyproject.toml). torch==2.13.0 goes in first: on these machines that is the CPU wheel on disk,
# whereas letting pip resolve torch itself would download a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvrank-installed
OUT    ?= out
PYTEST_ARGS ?=

.PHONY: install demo test bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

DEMO_DATA := $(OUT)/datasets/ml-latest-small
DEMO_EPOCHS ?= 3

# prepare -> encode -> train -> evaluate on ml-latest-small, on an embedded local Ray
demo: $(STAMP)
	$(PY) -m pipelines.prepare_data --dataset ml-latest-small --out $(OUT)
	$(PY) -m pipelines.encode_items --dataset-uri $(DEMO_DATA) --out $(OUT)
	$(PY) -m pipelines.train_ranker --dataset-uri $(DEMO_DATA) --out $(OUT) \
		--epochs $(DEMO_EPOCHS) --val-users 64 --negatives 63 --batch-size 32 --lr 2e-3
	$(PY) -m pipelines.evaluate --dataset-uri $(DEMO_DATA) --out $(OUT) \
		--checkpoint $(OUT)/checkpoints/ml-latest-small-text

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.prepare_data
	$(PY) -m benchmarks.encode
	$(PY) -m benchmarks.scoring
	$(PY) -m benchmarks.scoring --dtype bf16

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache
