# Two commands: `make serve` and `make test` each set up .venv on a fresh machine.
# `make serve` installs the server and the client alone (what running needs); `make test`
# adds the test extras (pytest, hypothesis, schemathesis, ...) to the same .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# editable installs of the three packages of this repository (the contract, the client,
# the server), without any extra
SERVE_INSTALL := $(PY) -m pip install -q -e ./contract -e ./clients/python -e .
SERVE_STAMP := $(VENV)/.installed-serve
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
# test processes for make test-slow and make test-torch (pytest-xdist); 0 runs them in this one
PYTEST_WORKERS ?= 2
# make test's: three on two cores, as its tests wait on servers a tenth of the time; each
# file on one process, so a module's server starts and its programs compile once
TEST_WORKERS ?= 3

.PHONY: serve test test-slow test-torch test-cluster test-protocol lint openapi docs clean docker-test

$(SERVE_STAMP): pyproject.toml clients/python/pyproject.toml contract/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(SERVE_INSTALL)
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ./contract -e './clients/python[test,jax]' -e '.[test]'
	touch $(STAMP)

serve: $(SERVE_STAMP)
	HOST=$(HOST) PORT=$(PORT) $(VENV)/bin/dxserve serve

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not docker and not slow and not cluster and not torch"; rc=$$?; [ $$rc -eq 5 ] && { echo "no tests ran"; exit 1; }; exit $$rc

# The long sweeps (full conformance grid over HTTP, ...): CI runs them after `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "slow and not torch"; rc=$$?; [ $$rc -eq 5 ] && { echo "no tests ran"; exit 1; }; exit $$rc

# Functions written in PyTorch: torch (about 5 GB with its CUDA libraries) goes into a
# virtualenv of its own, .venv-torch, so .venv and `make test` stay free of it; the tests
# marked `torch` run there (the torch conformance grids in process and over HTTP, a served
# nn.Module, progress, budgets), and the architecture tests check again that importing
# dxserve imports no torch.
TORCH_VENV := .venv-torch
TORCH_PY := $(TORCH_VENV)/bin/python
TORCH_STAMP := $(TORCH_VENV)/.installed
$(TORCH_STAMP): pyproject.toml clients/python/pyproject.toml contract/pyproject.toml
	test -x $(TORCH_PY) || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_PY) -m pip install -q --upgrade pip
	$(TORCH_PY) -m pip install -q -e ./contract -e './clients/python[test,jax]' -e '.[test,torch]'
	touch $(TORCH_STAMP)

test-torch: $(TORCH_STAMP)
	$(TORCH_PY) -m pytest -q -n $(PYTEST_WORKERS) -m "torch"; rc=$$?; [ $$rc -eq 5 ] && { echo "no tests ran"; exit 1; }; [ $$rc -eq 0 ] || exit $$rc
	$(TORCH_PY) -m pytest -q tests/project/test_architecture.py

# The bounded HTTP protocol (service/dxserve/http/protocol.py) against the lowest and the
# highest uvicorn that pyproject.toml allows, each installed apart and put first on the path.
UVICORN_RANGE := $(shell sed -n 's/.*"uvicorn\[standard\]\(.*\)",/\1/p' pyproject.toml)
UVICORN_LOWEST := $(shell echo '$(UVICORN_RANGE)' | sed -n 's/^>=\([0-9.]*\).*/\1/p')
test-protocol: $(STAMP)
	for spec in 'uvicorn==$(UVICORN_LOWEST)' 'uvicorn$(UVICORN_RANGE)'; do \
	  rm -rf .uvicorn-pinned && $(PY) -m pip install -q --no-deps --target .uvicorn-pinned "$$spec" || exit 1; \
	  PYTHONPATH=.uvicorn-pinned $(PY) -c 'import uvicorn; print("uvicorn", uvicorn.__version__, uvicorn.__file__)' || exit 1; \
	  PYTHONPATH=.uvicorn-pinned $(PY) -m pytest -q -m protocol || exit 1; \
	done; rm -rf .uvicorn-pinned

# Several processes on one store (SQLite and a real PostgreSQL that the tests start from
# Debian's binaries), --workers, and a local Ray cluster: the extras they need first.
CLUSTER_STAMP := $(VENV)/.installed-cluster
$(CLUSTER_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ./contract -e '.[test,postgres,ray]'
	touch $(CLUSTER_STAMP)

test-cluster: $(CLUSTER_STAMP)
	DXSERVE_REQUIRE_POSTGRES=1 DXSERVE_REQUIRE_RAY=1 $(PY) -m pytest -q -m "cluster"; rc=$$?; [ $$rc -eq 5 ] && { echo "no tests ran"; exit 1; }; exit $$rc

# Build docker/Dockerfile with podman (no Docker daemon needed) and smoke-test the running
# container from the host: docker/oci/build-and-run.sh builds, starts and waits for /health,
# then docker/smoke_check.py checks it. Docker image format keeps the HEALTHCHECK.
DOCKER_PORT ?= 18080
docker-test: $(STAMP)
	BUILDAH_FORMAT=docker bash docker/oci/build-and-run.sh -f docker/Dockerfile -c . -p $(DOCKER_PORT) -- $(PY) docker/smoke_check.py

# The documentation site (mkdocs.yml, docs/): built strictly, so a broken link, a missing
# page or an API reference that no longer resolves fails the build.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ./contract -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check service contract clients tests bench

openapi: $(STAMP)
	$(PY) -m dxserve.openapi_dump > openapi/openapi.json

clean:
	rm -rf $(VENV) $(TORCH_VENV) .pytest_cache .ruff_cache site
