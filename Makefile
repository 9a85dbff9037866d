# make demo   set up .venv if missing, then run the default job locally (prepare + train)
# make test   set up .venv if missing, then run the whole test suite (what CI runs)
# make test-fast   the unit and distributed tests only, no Ray cluster (the developer's loop)
# make docs   serve the documentation site on http://127.0.0.1:8000
VENV ?= .venv
STAMP := $(VENV)/.raylm-installed

.PHONY: env demo test test-fast docs bench-data

$(STAMP): pyproject.toml constraints.txt scripts/env.sh scripts/llama_cpp.sh
	bash scripts/env.sh $(VENV)
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raylm train

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=25 tests

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=10 tests/unit tests/distributed

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

bench-data: $(STAMP)
	$(VENV)/bin/python -m raylm.bench data --output runs/bench-data.json
