# make demo   set up .venv if missing, then run the default job locally (prepare + train)
# make test   set up .venv if missing, then run the whole test suite
VENV ?= .venv
STAMP := $(VENV)/.raylm-installed

.PHONY: env demo test bench-data

$(STAMP): pyproject.toml constraints.txt scripts/env.sh
	bash scripts/env.sh $(VENV)
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raylm train

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=25 tests

bench-data: $(STAMP)
	$(VENV)/bin/python -m raylm.bench data --output runs/bench-data.json
