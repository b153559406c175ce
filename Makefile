# Two entry points: `make demo` and `make test`. Each creates or reuses .venv and installs what it
# needs; a stamp file keyed on pyproject.toml skips the install when nothing changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch comes from the CPU wheel on this machine's disk; install it first so no dependency
# resolution can reach for a CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)

$(VENV)/.stamp-base: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e .
	touch $@

# NVIDIA NeMo AutoModel's K3 is the whole-model oracle (tests/test_model_oracle.py). Its own
# requirements (megatron, datasets, a transformers pin, ...) are not needed for the K3 modules on
# CPU, and an extra cannot say --no-deps, hence the separate step.
$(VENV)/.stamp-test: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps nemo-automodel==0.7.0
	touch $@ $(VENV)/.stamp-base

demo: $(VENV)/.stamp-base
	$(PY) -m mtplx_runtime demo

test: $(VENV)/.stamp-test
	$(PY) -m ruff check mtplx_runtime tests tools
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .mtplx-cache
