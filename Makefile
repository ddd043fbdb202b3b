# Two commands do all set-up: `make verify` (the main job) and `make test`.
# GPU nodes: make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,notebooks,triton
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(subst /,_,$(subst $(space),_,$(TORCH_SPEC)))-$(subst $(comma),_,$(EXTRAS))
space := $(subst ,, )
comma := ,

.PHONY: verify test lint notebooks test-fast test-thorough test-gpu bench bench-gpu mutation setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

verify: $(STAMP)
	$(PY) -m muon_dist.harness.conformance --origins --steps 5
	$(PY) -m muon_dist.harness.verify
	$(PY) -m muon_dist.harness.conformance --planted

test: lint
	$(PY) -m pytest -q

# ruff (configured in pyproject.toml): lint rules and the formatter's line length of 100
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test-fast: $(STAMP)
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -x

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# every notebook executed headless; its figures written to notebooks/figures/*.png (the stored notebooks unchanged)
notebooks: $(STAMP)
	$(PY) notebooks/run_all.py

# gloo on CPU: W = 1, 2, 4; with Dion beside: make bench ARGS="--dion ../dion" (a microsoft/dion checkout)
bench: $(STAMP)
	$(PY) -m benchmarks $(ARGS)

# one GPU: the step and kernel tables in one run; options in ARGS, e.g. make bench-gpu ARGS="--dion ../dion"
bench-gpu: $(STAMP)
	$(PY) -m benchmarks gpu $(ARGS)

# mutation testing of the tests (docs/mutation.md): cosmic-ray, one mutant at a time, on a seeded sample of
# each target's mutants (tests/mutation/TARGET.toml); empty: every target (run.py's DEFAULT_TARGETS), under an hour
MUTATION_TARGETS ?=

$(VENV)/.installed-mutation: $(STAMP)
	$(PY) -m pip install -q -e ".[mutation]"
	touch $@

mutation: $(VENV)/.installed-mutation
	nice -n 10 $(PY) tests/mutation/run.py $(MUTATION_TARGETS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
