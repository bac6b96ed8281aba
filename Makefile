# `make demo` and `make test` each do all set-up from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# No allocator to install or preload: importing prisma_jax tunes glibc's malloc itself (prisma_jax/core/runtime.py).

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,tpu,tunix]"   # tpu: libtpu, for the ahead-of-time TPU compile tests
	$(PY) -m pip install -q --no-deps google-tunix==0.1.7   # its deps: the tunix extra (docs/tunix.md)
	touch $(STAMP)

.PHONY: install test demo
install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not unverified" tests

demo: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(VENV)/bin/prisma demo   # the demo is a laptop-CPU run
