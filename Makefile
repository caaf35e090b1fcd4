# Everything installs into a project-local virtualenv; nothing outside it is touched.
# Every `python -m` runs with -P: from the repository root the folder operator/ would otherwise
# shadow the standard library's `operator` module.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch. On a CUDA machine: make TORCH=torch ...
TORCH ?= torch==2.13.0
PORT ?= 8000

.PHONY: install install-dev run test lint clean

$(PY):
	python3 -P -m venv $(VENV)
	$(PY) -P -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -P -m pip install -q "$(TORCH)"
	$(PY) -P -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -P -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The main job: the OpenAI-compatible server on the built-in default model (a tiny
# random-weight Llama: meaningless text). MODEL=/path/to/hf-model serves a real one.
run: install
	$(VENV)/bin/kvfleet-engine serve $(MODEL) --port $(PORT)

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# pytest exits 5 when it collects nothing: that is a failure here, not a pass.
test: lint
	$(PY) -P -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
