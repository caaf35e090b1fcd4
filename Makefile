# Everything installs into a project-local virtualenv; nothing outside it is touched.
VENV ?= .venv
PY := $(VENV)/bin/python
# The project's one torch version (images/torch.txt, which the engine images install too): the
# CPU build where pip finds it (its find-links, torch's CPU index). On a CUDA machine: make
# TORCH=torch ...
TORCH ?= $(shell grep -m1 '^torch==' images/torch.txt)
PORT ?= 8000

.PHONY: install install-dev tools run test lint e2e fuzz soak operator-soak images image-gpu image-gpu-test image-test clean FORCE

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# A strict editable install: a tree of links to the source files (build/__editable__.*), which
# editors and type checkers resolve kvfleet.* through (the default mode's import hook is
# invisible to them). A module added or removed since needs a new tree: the list of source
# files below changes, and so triggers the install again.
EDITABLE := --config-settings editable_mode=strict
$(VENV)/.sources: FORCE | $(PY)
	@find engine kernels operator router protocol telemetry -name '*.py' -not -path '*/__pycache__/*' | sort > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

# Not -q: the first install downloads torch and the rest (a minute or more), which pip's
# progress bars show; a repeated one prints a line per requirement already satisfied.
PIP_INSTALL := $(PY) -m pip install --disable-pip-version-check
$(VENV)/.installed: pyproject.toml setup.py $(VENV)/.sources | $(PY)
	$(PIP_INSTALL) "$(TORCH)"
	$(PIP_INSTALL) -e . $(EDITABLE)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP_INSTALL) -e ".[dev]" $(EDITABLE)
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# helm (and kubectl) for the chart tests and e2e: pinned, checksummed, into .tools/bin.
TOOLS := .tools/bin
$(TOOLS)/helm: scripts/fetch_tools.py
	python3 scripts/fetch_tools.py
	touch $@
tools: $(TOOLS)/helm

# The main job: the OpenAI-compatible server on the built-in default model,
# SmolLM2-135M-Instruct (a Q4_1 GGUF fetched once into ~/.cache/kvfleet, served as
# smollm2-135m-instruct). MODEL=/path/to/hf-model-or.gguf serves another; ARGS="..." passes
# engine flags (kvfleet-engine serve --help), e.g. ARGS="--max-model-len 4096".
ARGS ?=
run: install
	$(VENV)/bin/kvfleet-engine serve $(MODEL) --port $(PORT) $(ARGS)

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

# pytest exits 5 when it collects nothing: that is a failure here, not a pass.
# KVFLEET_REQUIRE_TOOLS: the tools were just installed, so a test that cannot find one fails.
# --durations: the slowest tests named in every run's log, since CI's time is bounded.
test: lint tools
	KVFLEET_REQUIRE_TOOLS=1 $(PY) -m pytest -q --durations=30; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# End to end on a kind cluster (docker, kind, kubectl needed): fails in one line saying what is
# missing rather than passing on skips.
e2e: install-dev tools
	KVFLEET_E2E_REQUIRED=1 PATH="$(CURDIR)/$(TOOLS):$$PATH" $(PY) -m pytest -q e2e

# The API fuzzer with a long, random example budget (CI runs a small, fixed one).
FUZZ_EXAMPLES ?= 3000
fuzz: install-dev
	KVFLEET_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/server/test_api_fuzz.py

# Ten minutes of good and hostile traffic against two engines behind a router (docs/security.md);
# fails unless clean: no 5xx, no process exit, /health p99 under 250 ms, nothing held after.
SOAK_SECONDS ?= 600
soak: install-dev
	$(PY) bench/soak.py --duration $(SOAK_SECONDS) --out soak.json

# Ten minutes of Kubernetes API faults (410s, ended watches, 409s, 500s, slow answers, resets)
# and users' edits against the operator as its own process, 20 services on kmock's emulator
# (bench/operator_soak.py); fails unless the process never exits, /healthz stays 200, the
# requests stay under the stated bounds, and every service converges once the faults stop.
OPERATOR_SOAK_SECONDS ?= 600
operator-soak: install-dev
	$(PY) bench/operator_soak.py --duration $(OPERATOR_SOAK_SECONDS) --out operator-soak.json

# Container images (docker; where no image registry is reachable, mmdebstrap builds the base):
# kvfleet/operator:dev and kvfleet/engine-cpu:dev, each one's build time and size printed.
# BASE_IMAGE=python:3.11-slim-bookworm builds from the public base instead.
images:
	images/start_dockerd.sh
	images/build.sh operator engine-cpu

# The GPU engine image (kvfleet/engine-gpu:dev, torch's CUDA wheels: several GB): not in CI.
image-gpu:
	images/start_dockerd.sh
	images/build.sh engine-gpu

# What can be checked of the GPU image without a GPU (tests/images/test_gpu_image.py): the CUDA
# torch and Triton it carries import, it serves on the CPU when no GPU is visible, and refuses in
# one line with --device cuda. Not in CI: the image's build (bench/RESULTS.md) is longer than its
# budget allows.
image-gpu-test: install-dev image-gpu
	KVFLEET_GPU_IMAGE_TEST=1 KVFLEET_REQUIRE_DOCKER=1 $(PY) -m pytest -q tests/images/test_gpu_image.py

# The images run as pods run them, black-box (tests/images): a chat answer from the engine
# container and through a router container, the operator container reconciling on kmock.
# KVFLEET_REQUIRE_DOCKER: nothing skips for want of docker or an image.
image-test: install-dev images
	KVFLEET_REQUIRE_DOCKER=1 $(PY) -m pytest -q tests/images

clean:
	rm -rf $(VENV) .tools .pytest_cache .ruff_cache .hypothesis
