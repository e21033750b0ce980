# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both create and reuse a virtual environment in .venv; torch is pinned by constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench install clean

# --no-compile: pip byte-compiles every module it installs (torch, triton, transformers: the install took 161 s with it
# and 71 s without on this 2-core machine, both beside two training jobs, pip's download cache warm); Python compiles
# the modules a run imports, once, as it imports them.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e ".[test,hf,gpu,data,datasets]"  # hf, gpu, data, datasets: tests/test_hf.py, the Triton kernels (under the interpreter) and the data preparation's tests run, not skip
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
