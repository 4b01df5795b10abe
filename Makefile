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

.PHONY: install demo test bench kv-sweep serve serve-load lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

DEMO_DATA := $(OUT)/datasets/ml-latest-small
DEMO_EPOCHS ?= 3
DEMO_KV_EPOCHS ?= 1

# the whole chain on ml-latest-small on an embedded local Ray: prepare -> encode -> train ->
# evaluate -> analyse the KV -> fit the CollectiveKV pools -> build user states -> evaluate from
# them -> serve them, rank one user's catalog, short load; tables and plots in out/reports/demo/
demo: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m services.demo --out $(OUT) \
		--epochs $(DEMO_EPOCHS) --kv-epochs $(DEMO_KV_EPOCHS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.prepare_data
	$(PY) -m benchmarks.encode
	$(PY) -m benchmarks.scoring
	$(PY) -m benchmarks.scoring --dtype bf16

# the CollectiveKV sweep (M x d_u, int8 and low-rank baselines) on the demo's trained ranker
kv-sweep: $(STAMP)
	$(PY) -m benchmarks.kv_sweep --dataset-uri $(DEMO_DATA) --out $(OUT) \
		--checkpoint $(OUT)/checkpoints/ml-latest-small-text

# the Serve app on 127.0.0.1:8000 over the demo's user states (make demo first)
serve: $(STAMP)
	RAY_AUTH_MODE=disabled $(VENV)/bin/serve run --address local infra/serve_config.yaml

# HTTP load on the Serve app vs the full-forward baseline, over the demo's user states
serve-load: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m benchmarks.serve_load \
		--manifest-uri $(OUT)/user_states/ml-latest-small-ckv

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache
