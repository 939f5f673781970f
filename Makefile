# Every target works on a fresh machine: `setup` creates .venv when missing.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kasoku-installed
# torch is pinned here, not in pyproject: 2.13.0 is the CPU build on this machine's disk;
# an open range would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# ONNX Runtime is an extra: `cpu` (onnxruntime) or `gpu` (onnxruntime-gpu: CUDA and TensorRT providers),
# never both. `make setup ORT=gpu` on a machine with an NVIDIA GPU.
ORT := cpu

.PHONY: setup browser demo test test-fast test-slow bench lint clean

setup: $(STAMP)

# xFormers 0.0.35, the newest build on the registry, is built for torch 2.10 with CUDA: beside the pinned CPU torch its
# kernels cannot load, and every import of it (diffusers imports it when installed) prints a warning. Only the tests
# of xFormers attention's export (the first seed article's subject) need it, so it is installed apart, into .xformers,
# which tests/conftest.py puts on the tests' sys.path: `make setup`, `kasoku demo` and every command never import it.
XFORMERS := .xformers
$(XFORMERS)/.installed: $(STAMP)
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(XFORMERS) xformers==0.0.35
	touch $@

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[$(ORT),dev,openvino,ray,serve]' $(TORCH_PIN)
	touch $(STAMP)

# The web page test drives Debian's chromium through Playwright (Playwright's own browser download
# does not work here). Installed when missing and apt-get can (as root); otherwise that one test skips.
browser:
	@test -x /usr/bin/chromium || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
		|| echo "chromium could not be installed: the web page test of kasoku serve will be skipped"

demo: setup
	$(VENV)/bin/kasoku demo

# Two workers (pytest-xdist), a test file per worker at a time: exports are single-threaded, so two
# cores run two files' exports at once. Each worker builds the session's tiny artefacts once; files that build the
# same engines go to one worker together (tests/conftest.py: SHARED_BUILDS). Files go out in
# collection order, the slowest first (tests/conftest.py: SLOWEST_FILES).
# `make test WORKERS=0` runs in one process.
WORKERS := 2

test: setup browser $(XFORMERS)/.installed
	$(PY) -m pytest -q --durations=25 $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadfile --no-loadscope-reorder)

# Tests marked slow (AOTInductor compiles: minutes each on two cores) are skipped by `make test`, run here.
test-slow: setup $(XFORMERS)/.installed
	KASOKU_RUN_SLOW=1 $(PY) -m pytest -q -m slow

# The unit tier: no export, no engine build (under two minutes); `make test` runs both tiers.
test-fast: setup $(XFORMERS)/.installed
	$(PY) -m pytest -q -m unit

bench: setup
	$(PY) benchmarks/tiny_pipeline.py
	$(PY) benchmarks/batch_tiny.py
	$(PY) benchmarks/lora.py
	$(PY) benchmarks/serve_tiny.py
	$(PY) benchmarks/full_sd15.py
	$(PY) benchmarks/full_sdxl.py

lint: setup
	$(VENV)/bin/ruff check src tests examples benchmarks

clean:
	rm -rf $(VENV) $(XFORMERS) build *.egg-info src/*.egg-info
