# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both create and reuse a virtual environment in .venv; torch is pinned by constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,hf,gpu,data,datasets]"  # hf, gpu, data, datasets: tests/test_hf.py, the Triton kernels (under the interpreter) and the data preparation's tests run, not skip
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)  # --force: a second `make demo` replaces runs/demo (only a folder titans made) instead of failing
	$(BIN)/titans demo --force

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/titans bench memory

clean:
	rm -rf $(VENV)
