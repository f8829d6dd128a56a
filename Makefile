# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint unit slurm-up slurm-down clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

## Run the whole loop on the embedded default (simulated cluster, embedded broker, chDB).
demo: $(STAMP)
	$(VENV)/bin/trainmedic demo

## Lint, type-check and run every test. As root it installs and starts the local Slurm cluster.
test: $(STAMP) lint
	@if [ "$$(id -u)" = 0 ]; then bash infra/slurm/start.sh; \
	else echo "not root: the local Slurm cluster cannot start; its tests will be skipped"; fi
	$(PY) -m pytest -ra

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy schemas producers streams sinks trainmedic sim tests bench

unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

slurm-up:
	bash infra/slurm/start.sh

slurm-down:
	bash infra/slurm/stop.sh

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
