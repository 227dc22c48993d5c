# Asteroid: `make run` starts the site, `make test` runs the whole suite; both set up .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint venv

# The stamp is newer than requirements.txt once its packages are installed: pip runs only after it changes.
$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt | $(PY)
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(PY) -m webapp.launch

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
