# Shoal: two set-up commands, `make demo` and `make test`, on a machine with Python 3.11, pip and make.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-heavy bench soak faults fuzz lint typecheck clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev,bench,torch,examples,ray]'
	$(PY) -m pip install --quiet --no-deps recbole==1.2.1 pykeen==1.11.1 gensim==4.4.0
# numba's kernels into its cache now, not in the first job (about 10 s of the first demo's 16 s)
	$(PY) -c 'import numpy, shoal.storage.kernels as k; k.warm_up(numpy.float32); k.warm_up(numpy.float64)'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/mf/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

test-heavy: $(STAMP)
	$(PY) -m pytest -q -m heavy

bench: $(STAMP)
	$(PY) benchmarks/bench_pull_push.py
	$(PY) benchmarks/bench_request_cost.py
	$(PY) benchmarks/bench_local_access.py
	$(PY) benchmarks/bench_mf.py
	$(PY) benchmarks/bench_consistency.py
	$(PY) benchmarks/bench_emulated_hosts.py
	$(PY) benchmarks/bench_slicing.py
	$(PY) benchmarks/bench_replication.py
	$(PY) benchmarks/bench_replica_failures.py
	$(PY) benchmarks/bench_kge.py
	$(PY) benchmarks/bench_placement.py
	$(PY) benchmarks/bench_server_cpu.py
	$(PY) benchmarks/bench_word2vec.py
	$(PY) benchmarks/w2v_staleness.py
	$(PY) benchmarks/bench_kge_hosts.py

soak: $(STAMP)
	$(PY) benchmarks/soak.py

fuzz: $(STAMP)
	$(PY) -m pip install --quiet 'atheris>=2.3' || true
	$(PY) benchmarks/fuzz.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info

faults: $(STAMP)
	$(PY) benchmarks/faults.py
