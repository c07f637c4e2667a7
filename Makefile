# make demo  -- set up everything (system packages, .venv, kp, vkattn), then run the main job
# make test  -- the same set-up, then the whole pytest suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-validation perf clean
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m vkattn demo

test: setup
	$(PY) -m pytest -q

test-validation: setup
	bash scripts/validation.sh

perf: setup
	$(PY) -m perf

clean:
	rm -rf $(VENV) build *.egg-info perf/out
