# Two commands on a fresh machine with Python 3.11 and pip:  make demo   and   make test.
# Each creates .venv once (torch first, the pinned CPU-friendly version), then reuses it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LOCK   := requirements.lock
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | cksum | cut -d' ' -f1)
TORCH  ?= torch==2.13.0
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
PARAMS ?= params/smoke.yaml
WORK   ?= work
DEMO_ARGS ?=

.PHONY: setup lock demo test test-all lint bench gpu-report gpu-wheels gpu-baseline gpu-proof clean

setup: $(STAMP)

# torch first (its own build for this machine), then exactly the locked versions of
# everything else (hashes checked), then the project itself.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m pip check
	rm -f $(VENV)/.installed-* && touch $@

lock: setup  ## re-resolve requirements.lock from pyproject.toml's ranges (then run make test)
	$(BIN)/uv pip compile pyproject.toml --extra dev --generate-hashes --python-version 3.11 \
	    --python-platform x86_64-manylinux_2_28 --override requirements.overrides -o $(LOCK)

demo: setup  ## the smoke pipeline end to end (Prefect's temporary API, MLflow on SQLite)
	$(BIN)/python -m flows.wmt14_ende $(PARAMS) --work-dir $(WORK) $(DEMO_ARGS)

test: setup  ## the default test suite (CPU, minutes), on two workers
	$(BIN)/python -m pytest -q -n 2

test-all: setup  ## also the slow tests, on one worker (some time how fast a stop ends)
	$(BIN)/python -m pytest -q -m "not gpu"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m benchmarks.model_step
	$(BIN)/python -m benchmarks.data_pipeline
	$(BIN)/python -m benchmarks.train_throughput
	$(BIN)/python -m benchmarks.decode

# On a GPU machine whose CUDA PyTorch is already installed (an NGC container): no setup, no
# torch reinstall; the machine's python. Writes benchmarks/results/<date>-<gpu>/report.{md,json}.
gpu-report:
	test ! -d $(WHEELS) || $(PYTHON) -m pip install -q --no-index --no-deps $(WHEELS)/*.whl
	$(PYTHON) -m benchmarks.gpu_report $(GPU_REPORT_ARGS)

# What such an image lacks (pydantic; CTranslate2 and sacremoses, the peers), as the
# lock's versions for its Python, into an ignored folder to carry to a machine with no
# index: `make gpu-wheels` here, then `make gpu-report` there installs them, --no-deps.
# typing-extensions too: the image has one of unknown version, and pydantic needs >= 4.16.
WHEELS ?= .whl
GPU_PYTHON ?= 3.12
GPU_PACKAGES := pydantic pydantic-core annotated-types typing-inspection typing-extensions \
    ctranslate2 sacremoses
gpu-wheels: setup
	$(BIN)/python -m pip download -q --no-deps --only-binary :all: -d $(WHEELS) \
	    --python-version $(GPU_PYTHON) --platform manylinux_2_28_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    $(foreach p,$(GPU_PACKAGES),$(shell grep -m1 -io '^$(p)==[^ ]*' $(LOCK)))

# The GPU proof (benchmarks/gpu_report/proof.py): at most 8 minutes on one H100 or H200,
# phase by phase. Here first, `make gpu-wheels gpu-baseline`: the wheels, the base commit's
# tree (the "before" of its figures) into .baseline/, and COMMIT (the tree's commit, where
# .git does not travel); carry .whl, .baseline and COMMIT. There, on the image's python, e.g.
#   make gpu-proof PYTHON=python3 GPU_PROOF_ARGS="--out $OUT/proof"
# The wheels go to a folder of their own on PYTHONPATH: the image's site-packages may be
# read-only.
BASELINE ?= 6cf3fe3
GPU_SITE ?= /tmp/site
gpu-baseline:
	rm -rf .baseline && mkdir .baseline
	git archive $(BASELINE) transformer benchmarks params | tar -x -C .baseline
	git rev-parse --short $(BASELINE) > .baseline/COMMIT
	printf '%s + %s changed files\n' "$$(git rev-parse --short HEAD)" \
	    "$$(git status --porcelain | wc -l | tr -d ' ')" > COMMIT

gpu-proof:
	test ! -d $(WHEELS) || $(PYTHON) -m pip install -q --no-index --no-deps --no-compile \
	    --no-cache-dir --upgrade --target $(GPU_SITE) $(WHEELS)/*.whl
	PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m benchmarks.gpu_report \
	    --plan proof $(GPU_PROOF_ARGS)

clean:
	rm -rf $(WORK)
