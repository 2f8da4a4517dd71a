# The two commands a newcomer runs:  make demo   and   make test
# Both create .venv on first use and are fast the second time.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# pip only reinstalls (and rebuilds the Cython extension) when these change
BUILD_INPUTS := pyproject.toml setup.py src/smb2/version.py $(wildcard src/smb2/*.pyx) \
                $(wildcard src/smb2/_core_parts/*.pxi src/smb2/_core_parts/*.h)

.PHONY: demo test test-host test-rdma lint typecheck docs wheel pytest clean

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
	@# the torch adapter's test: an exact CPU build, never a range (that would
	@# pull a multi-GB CUDA build); where it cannot be had the test skips
	$(BIN)/python -m pip install -q torch==2.13.0 \
	  || echo "make: torch==2.13.0 could not be installed: the smb2.torch test will skip"
	@# bench tta's peer (torchft's DiLoCo), beside that torch: where torch is there it must install
	if $(BIN)/python -c 'import torch' 2>/dev/null; then $(BIN)/python -m pip install -q -e '.[tta]'; fi
	touch $@ $(VENV)/.installed-runtime $(VENV)/.installed-demo $(VENV)/.installed-docs

# the demo's own install: smb2, scikit-learn (the digits) and torch, an exact
# CPU build (a range would pull a multi-GB CUDA build)
$(VENV)/.installed-demo: $(BUILD_INPUTS) | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[demo]' torch==2.13.0
	touch $@ $(VENV)/.installed-runtime

# the documentation site's tools alone: no root, no system packages
$(VENV)/.installed-docs: $(BUILD_INPUTS) | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

# the quick bandwidth demo, then a torch model trained by 4 torchrun workers
# through smb2.torch.AsyncOptimizer beside one process, and `smb2 ls` of
# their store (< 2 min after the install)
demo: $(VENV)/.installed-demo
	$(BIN)/smb2 demo
	$(BIN)/python examples/torch_demo.py

# the host tests (tcp), then the same suite over rdma in a soft-RoCE VM
test: test-host
	tools/rdma_tier.sh $(RDMA_PYTEST_ARGS)

test-host: $(VENV)/.installed-test lint typecheck docs pytest

# only the soft-RoCE tier (one VM boot; see tools/rdma_tier.sh)
test-rdma: $(VENV)/.installed-test
	tools/rdma_tier.sh $(RDMA_PYTEST_ARGS)

# ruff, then the import directions of docs/design.md ("Layers"; the contracts
# are in pyproject.toml, [tool.importlinter])
lint: $(VENV)/.installed-test
	$(BIN)/ruff check $(wildcard src tests tools examples)
	$(BIN)/lint-imports --no-cache

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy src/smb2 tools

# the documentation site into build/site, warnings as errors (mkdocs.yml)
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# the sdist and a manylinux wheel (libibverbs left to the host) in dist/
wheel: $(VENV)/.installed-test
	$(BIN)/python tools/build_wheel.py dist

# the host suite on pytest-xdist workers, one per core (PYTEST_WORKERS=0: in
# this process), then the timing-sensitive tests (mark "alone") by themselves;
# tests/conftest.py says how tests stay apart and which loops and transports
# each runs on.  pytest exits 5 when it collected no test: not
# a failure of the project
PYTEST_WORKERS ?= auto
pytest: $(VENV)/.installed-test
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist load -m "not alone" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/pytest -p no:xdist -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) build dist src/*.egg-info src/smb2/_core.c src/smb2/_verbs.c src/smb2/*.so .pytest_cache .mypy_cache .ruff_cache
