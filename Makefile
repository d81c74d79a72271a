# Two commands: `make serve` and `make test` each set up .venv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: serve test test-all lint openapi bench clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --config-settings editable_mode=compat -e './clients/python[test,jax]' -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	HOST=$(HOST) PORT=$(PORT) $(VENV)/bin/dxserve serve

test: $(STAMP)
	$(PY) -m pytest -q -m "not docker"; rc=$$?; [ $$rc -eq 5 ] && { echo "no tests ran"; exit 1; }; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check service clients tests bench

openapi: $(STAMP)
	$(PY) -m dxserve.openapi_dump > openapi/openapi.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
