# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench unit system-deps slurm-up slurm-down clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

## Run the whole loop on the embedded default (simulated cluster, embedded broker, chDB).
demo: $(STAMP)
	$(VENV)/bin/trainmedic demo

## Lint, type-check and run every test, TEST_JOBS at a time (pytest-xdist; docs/testing.md). As root
## it installs what the tests drive (Slurm, sshd, chromium from Debian) and starts both local Slurm
## clusters first, once for all the test workers.
TEST_JOBS ?= 2
test: $(STAMP) lint system-deps
	@if [ "$$(id -u)" = 0 ]; then bash infra/slurm/start.sh && bash infra/slurm/start-2411.sh; \
	else echo "not root: the local Slurm clusters cannot start; their tests will be skipped"; fi
	$(PY) -m pytest -ra -n $(TEST_JOBS) --dist loadgroup --durations=25

system-deps:
	@if [ "$$(id -u)" = 0 ]; then \
	  missing=""; \
	  [ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	  [ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing:$$missing"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; \
	  fi; \
	else echo "not root: sshd/chromium tests skip unless already installed"; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy schemas bus producers streams sinks slurmio trainmedic sim tests bench

## The end-to-end benchmark (minutes): latency, accuracy, status quo, scale; reports in bench/results/, then
## docs/benchmarks.md and its headline figures from the result files (python -m bench.render).
bench: $(STAMP)
	$(VENV)/bin/trainmedic bench
	$(PY) -m bench.render

unit: $(STAMP)
	$(PY) -m pytest tests/unit -q -n $(TEST_JOBS)

slurm-up:
	bash infra/slurm/start.sh
	bash infra/slurm/start-2411.sh

slurm-down:
	bash infra/slurm/stop.sh
	bash infra/slurm/stop-2411.sh

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
