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

.PHONY: verify test lint notebooks test-fast test-thorough test-gpu gpu-report bench bench-gpu mutation setup clean field

setup: $(STAMP)

# the extras go beside the torch of TORCH_SPEC, never in its place: pip would otherwise replace a torch whose pins
# conflict with them (torch 2.9.1's CUDA build pins triton 3.5.1, the triton extra 3.9.0) and the tests run on another
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" "torch==$$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))')" || { \
		echo "make setup: .[$(EXTRAS)] cannot be installed beside TORCH_SPEC=\"$(TORCH_SPEC)\" without replacing that torch; \
	a CUDA build brings the triton it pins: run with EXTRAS=dev,notebooks" >&2; exit 1; }
	touch $@

verify: $(STAMP)
	$(PY) -m muon_check --origins --steps 5
	$(PY) -m muon_check.verify
	$(PY) -m muon_check --planted

# pytest-xdist workers (TEST_JOBS=0: one process); each test module runs on one worker (--dist loadscope), so a
# module's fixtures are made once
TEST_JOBS ?= 2

test: lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadscope

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

# every GPU check in one run, each command's log and report kept in gpu-report/ (tests/gpu/run_all.py --help)
gpu-report: $(STAMP)
	$(PY) tests/gpu/run_all.py $(ARGS)

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

# The field systems' own Muon code under the check (docs/field-systems.md): a separate venv (their pins would replace
# our torch or transformers), no CUDA wheels (checked by a dry run first), then tests/test_system_adapters.py and the
# table, then the rows not in it and the setups' audits and invariance (each reported; a departing row does not stop
# the rest). Checkouts by path: make field XTUNER=../xtuner LLAMAFACTORY=../LlamaFactory EMERGING=../Emerging-Optimizers
# AREAL=../areal-pr1270 (a folder holding areal/engine/fsdp_utils/muon.py of inclusionAI/AReaL PR 1270 at 7d18cca0)
# TORCHTITAN=../torchtitan (pytorch/torchtitan at PR 4060's merge, bb90ff9c) LEROBOT=../lerobot (a folder holding
# src/lerobot/optim/muon.py of huggingface/lerobot at 85b2fd6c) CANZONA=../FSDP-Canzona (liangyuwang/FSDP-Canzona)
FIELD_VENV ?= .venv-field
FIELD_PY := $(FIELD_VENV)/bin/python
FIELD_EXTRA := $(FIELD_VENV)/extra/megatron-core-0.19.2
FIELD_DEPS := transformers==5.9.0 einops hjson msgpack ninja psutil py-cpuinfo pydantic tqdm absl-py \
	typing_extensions triton==3.9.0 pytest pytest-timeout hypothesis numpy scipy expecttest
# what llamafactory.train.trainer_utils imports (its builder, for the setup audit), at the versions its 0.9.5 pins
FIELD_LLAMAFACTORY_DEPS := peft==0.18.1 accelerate==1.11.0 datasets==4.0.0 trl==0.24.0 multiprocess==0.70.19 \
	pandas==3.1.1 python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6 six==1.17.0 pyarrow==26.0.1 dill==0.4.1 \
	xxhash==4.1.0 omegaconf==2.4.0 requests==2.34.2 urllib3==2.8.0
# what xtuner/v1/config/optim.py imports (its MuonConfig builder, for its setup), at the versions checked
FIELD_XTUNER_DEPS := addict==2.4.0 attrs==26.1.0 cyclopts==5.5.2 docstring-parser==0.18.0 docutils==0.23 \
	loguru==0.7.3 mmengine==0.10.7 platformdirs==4.14.8 rich-rst==2.2.0 termcolor==3.3.0 yapf==0.43.0
# the field systems as training setups (muon_check/adapters/field_setups.py): audit and invariance
FIELD_SETUPS := DeepSpeedSetup DeepSpeedSetupNoClip DeepSpeedSetupBf16 DeepSpeedSetupDocExample \
	DeepSpeedSetupDocExampleNoReduceScatter LlamaFactorySetup LlamaFactoryZero3Setup LlamaFactoryV1Setup
FIELD_INVARIANCE := DeepSpeedSetup DeepSpeedSetupNoClip DeepSpeedSetupStandardNS DeepSpeedSetupBf16 \
	DeepSpeedSetupDocExampleNoReduceScatter LlamaFactoryV1Setup
XTUNER ?=
AREAL ?=
LLAMAFACTORY ?=
EMERGING ?=
TORCHTITAN ?=
LEROBOT ?=
CANZONA ?=
FIELD_ENV := MUON_XTUNER_CHECKOUT=$(XTUNER) MUON_LLAMAFACTORY_CHECKOUT=$(LLAMAFACTORY) MUON_AREAL_CHECKOUT=$(AREAL) \
	MUON_EMERGING_CHECKOUT=$(EMERGING) MUON_MEGATRON_PATH=$(abspath $(FIELD_EXTRA)) \
	MUON_TORCHTITAN_CHECKOUT=$(TORCHTITAN) MUON_LEROBOT_CHECKOUT=$(LEROBOT) MUON_CANZONA_CHECKOUT=$(CANZONA)
FIELD_ADAPTERS := LlamaFactoryV0Muon LlamaFactoryV1Muon VeomniMuon DeepSpeedMuon DeepSpeedMuonZero1 \
	DeepSpeedMuonZero2 DeepSpeedMuonZero3 XtunerMuon EmergingMuon MegatronTensorParallelMuon \
	MegatronTensorParallelMuonBlockwise MegatronTensorParallelMuonDistributed ArealMuon
# the rows whose adapters live in modules of their own (module:class under muon_check.adapters)
FIELD_MODULE_ADAPTERS := torchtitan:TorchtitanDistributedMuon lerobot:LerobotDistributedMuon canzona:CanzonaMuon \
	megatron_layerwise:MegatronLayerWiseMuon xtuner_paths:XtunerPadAll2All xtuner_paths:XtunerFusedAgrsNccl

field:
	test -x $(FIELD_PY) || $(PYTHON) -m venv $(FIELD_VENV)
	$(FIELD_PY) -m pip install -q $(TORCH_SPEC)
	! $(FIELD_PY) -m pip install --dry-run $(FIELD_DEPS) 2>&1 | grep -i -E "would install.*(nvidia-|cuda-)"
	$(FIELD_PY) -m pip install -q $(FIELD_DEPS)
	$(FIELD_PY) -m pip install -q --no-deps llamafactory==0.9.5 veomni==0.1.12
	$(FIELD_PY) -m pip install -q --no-deps $(FIELD_LLAMAFACTORY_DEPS)
	$(FIELD_PY) -m pip install -q --no-deps $(FIELD_XTUNER_DEPS)
	DS_BUILD_OPS=0 $(FIELD_PY) -m pip install -q --no-deps --no-build-isolation deepspeed==0.19.8
	$(FIELD_PY) -m pip install -q --no-deps --ignore-requires-python --target $(FIELD_EXTRA) \
		--python-version 3.12 --only-binary=:all: megatron-core==0.19.2 emerging-optimizers==0.3.0
	$(FIELD_PY) -m pip install -q --no-deps -e .
	$(FIELD_ENV) $(FIELD_PY) -m muon_check.adapters.systems
	$(FIELD_ENV) $(FIELD_PY) -m pytest -q -rs tests/test_system_adapters.py tests/test_system_torchtitan.py \
		tests/test_system_lerobot.py tests/test_system_canzona.py tests/test_system_megatron_layerwise.py \
		tests/test_system_xtuner_paths.py
	-$(FIELD_ENV) $(FIELD_PY) -m muon_check --markdown --json field-systems.json \
		$(foreach a,$(FIELD_ADAPTERS),--adapter muon_check.adapters.systems:$(a)) \
		$(foreach a,$(FIELD_MODULE_ADAPTERS),--adapter muon_check.adapters.$(a))
	-$(FIELD_ENV) $(FIELD_PY) -m muon_check --adapter muon_check.adapters.systems:DeepSpeedMuonZero3 \
		--adapter muon_check.adapters.systems:DeepSpeedMuonZero3InMemory --world-sizes 2 \
		--families checkpoint checkpoint_unstepped
	-$(FIELD_ENV) $(FIELD_PY) -m muon_check --adapter muon_check.adapters.systems:VeomniMuonGram \
		--world-sizes 1 2
	-$(FIELD_ENV) $(FIELD_PY) -m muon_check --adapter muon_check.adapters.systems:DeepSpeedMuonGram \
		--world-sizes 1 2 --families even straddle mixed
	-$(foreach s,$(FIELD_SETUPS),$(FIELD_ENV) $(FIELD_PY) -m muon_check --audit \
		muon_check.adapters.field_setups:$(s) --world-sizes 2 --micro-batches 2;)
	-$(FIELD_ENV) $(FIELD_PY) -m muon_check --audit muon_check.adapters.field_setups:VeomniSetup \
		--sharding hsdp --world-sizes 4 --micro-batches 1
	-$(FIELD_ENV) $(FIELD_PY) -m muon_check --audit muon_check.adapters.field_setups:VeomniSetup \
		--world-sizes 1 --micro-batches 2
	-$(foreach s,$(FIELD_INVARIANCE),$(FIELD_ENV) $(FIELD_PY) -m muon_check \
		--invariance muon_check.adapters.field_setups:$(s) --world-sizes 1 2 4;)
	-$(foreach s,XtunerSetup XtunerSetupNccl XtunerSetupPadAll2All,$(FIELD_ENV) $(FIELD_PY) -m muon_check \
		--audit muon_check.adapters.xtuner_paths:$(s) --world-sizes 2 --micro-batches 2;)
	-$(FIELD_ENV) $(FIELD_PY) -m muon_check --invariance \
		muon_check.adapters.xtuner_paths:XtunerSetupNccl --world-sizes 1 2
	-$(FIELD_ENV) $(FIELD_PY) -m muon_check.adapters.xtuner_paths

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
