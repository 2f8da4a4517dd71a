# The two commands a newcomer runs:  make demo   and   make test
# Both create .venv on first use and are fast the second time.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# pip only reinstalls (and rebuilds the Cython extension) when these change
BUILD_INPUTS := pyproject.toml setup.py $(wildcard src/smb2/*.pyx)

.PHONY: demo test test-host test-rdma lint typecheck pytest clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# the libibverbs headers (apt, when root), so the build includes smb2._verbs
$(VENV)/.sysdeps: tools/host_deps.sh | $(BIN)/python
	tools/host_deps.sh
	touch $@

$(VENV)/.installed-runtime: $(BUILD_INPUTS) $(VENV)/.sysdeps | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(BUILD_INPUTS) $(VENV)/.sysdeps | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed-runtime

demo: $(VENV)/.installed-runtime
	$(BIN)/smb2 demo

# the host tests (tcp), then the same suite over rdma in a soft-RoCE VM
test: test-host
	tools/rdma_tier.sh $(RDMA_PYTEST_ARGS)

test-host: $(VENV)/.installed-test lint typecheck pytest

# only the soft-RoCE tier (one VM boot; see tools/rdma_tier.sh)
test-rdma: $(VENV)/.installed-test
	tools/rdma_tier.sh $(RDMA_PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check $(wildcard src tests tools examples)

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy src/smb2

# pytest exits 5 when it collected no test: not a failure of the project
pytest: $(VENV)/.installed-test
	$(BIN)/pytest $(PYTEST_ARGS) || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) build src/*.egg-info src/smb2/_core.c src/smb2/_verbs.c src/smb2/*.so .pytest_cache .mypy_cache .ruff_cache
