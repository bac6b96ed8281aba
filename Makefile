# `make demo` and `make test` each do all set-up from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# XLA:CPU allocates a program's large buffers afresh on every call, and glibc maps and unmaps them each time;
# on VMs where page faults are slow, that alone makes CPU runs several times slower and very noisy
# (docs/benchmarks.md). jemalloc keeps the pages mapped: used when installed (apt install libjemalloc2).
JEMALLOC := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /lib/x86_64-linux-gnu/libjemalloc.so.2 \
                                   /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2))
JEMALLOC_ENV = LD_PRELOAD=$(JEMALLOC) MALLOC_CONF=retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1
RUN_ENV := $(if $(JEMALLOC),$(JEMALLOC_ENV))

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,tpu]"   # tpu: libtpu, for the ahead-of-time TPU compile tests
	touch $(STAMP)

.PHONY: install test demo
install: $(STAMP)

test: $(STAMP)
	$(RUN_ENV) $(PY) -m pytest -q -n 2 --dist loadfile -m "not unverified" tests

demo: $(STAMP)
	$(RUN_ENV) JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(VENV)/bin/prisma demo   # the demo is a laptop-CPU run
