# vllm-repro: make cpu-repro (the main job) and make test. Every target sets itself up.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
REPRO := $(BIN)/vllm-repro
SCENARIO ?= scenarios/vllm-23347-priority-preempt-scheduled.yaml
CATALOG ?=
# CATALOG=all also runs every entry on the newest release (it must be clean there)
NEWEST ?= 0.33.0
JOBS ?=
REPORTS ?= reports
# Torch source (see README): a local wheelhouse, or PyTorch's CPU index.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_WHEEL_DIR ?=
export TORCH_VERSION TORCH_INDEX_URL TORCH_WHEEL_DIR

.PHONY: venv cpu-repro test test-unit bench clean help

help:
	@echo "make cpu-repro   reproduce the default catalog bug (vLLM #23347) on its releases"
	@echo "make cpu-repro CATALOG=all   the whole catalog (each entry also on NEWEST=$(NEWEST))"
	@echo "make test        unit tests and the real-release scenario tests"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

cpu-repro: venv
	@start=$$(date +%s); \
	if [ "$(CATALOG)" = "all" ]; then \
	  $(REPRO) catalog run --also-on $(NEWEST) $(if $(JOBS),--jobs $(JOBS)) --reports $(REPORTS); \
	else $(REPRO) run $(SCENARIO) $(if $(JOBS),--jobs $(JOBS)) --reports $(REPORTS); fi; rc=$$?; \
	echo "cpu-repro: $$(( $$(date +%s) - start ))s wall"; exit $$rc

test: venv
	$(BIN)/python -m pytest -q --junitxml=$(REPORTS)/junit.xml tests

test-unit: venv
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(REPORTS) .pytest_cache
