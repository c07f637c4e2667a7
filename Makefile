# make demo  -- set up everything (system packages, .venv, kp, vkattn), then run the main job
# make test  -- the same set-up, then the whole pytest suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-validation perf gpu-report gpu-bench clean
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

gpu-report: setup      # registers, spills, LDS, waves per AMD family from RADV's compiler: no GPU needed
	$(PY) -m perf gpu

gpu-bench: setup       # the perf cases on this machine's Vulkan GPU (VKATTN_DEVICE picks one)
	$(PY) -m perf gpubench

clean:
	rm -rf $(VENV) build *.egg-info perf/out
