# make demo   set up .venv with what raylm needs if missing, then run the default job locally
#             (prepare + train)
# make test   set up .venv if missing, then run the whole test suite (what CI runs)
# make test-fast   the unit, security and distributed tests, no Ray cluster (the developer's loop)
# make test-latest the unit and distributed tests on the newest releases pyproject.toml admits,
#                  in .venv-latest (scripts/test_latest.sh)
# make docs   serve the documentation site on http://127.0.0.1:8000
VENV ?= .venv
# What raylm needs to run (the demo), and all the tests need besides (their extras, and
# llama.cpp, which only the tests run): a demo does not wait for the test environment.
RUN_STAMP := $(VENV)/.raylm-run-installed
STAMP := $(VENV)/.raylm-installed

.PHONY: env demo test test-fast test-latest docs bench-data

$(RUN_STAMP): pyproject.toml constraints.txt scripts/env.sh
	RAYLM_EXTRAS= bash scripts/env.sh $(VENV)
	touch $(RUN_STAMP)

# One install of everything (llama.cpp compiles while the packages download); it holds what
# the demo needs too.
$(STAMP): pyproject.toml constraints.txt scripts/env.sh scripts/llama_cpp.sh
	bash scripts/env.sh $(VENV)
	touch $(STAMP) $(RUN_STAMP)

env: $(STAMP)

demo: $(RUN_STAMP)
	$(VENV)/bin/raylm train

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=25 tests

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=10 tests/unit tests/distributed tests/security

test-latest:
	bash scripts/test_latest.sh .venv-latest

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

bench-data: $(STAMP)
	$(VENV)/bin/python -m raylm.bench data --output runs/bench-data.json
