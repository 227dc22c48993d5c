# Asteroid: `make run` starts the site, `make test` runs the whole suite; both set up .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint venv browser

# The stamp is newer than requirements.txt once its packages are installed: pip runs only after it changes.
$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt | $(PY)
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(PY) -m webapp.startsite

# The browser test drives Debian's chromium (Playwright downloads no browser here). Installed when missing and
# this is a Debian machine where we are root; elsewhere tests/e2e says loudly why it skips.
browser:
	@if ! command -v chromium >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's chromium for the browser test"; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				chromium >/dev/null) || echo "could not install chromium: tests/e2e will skip"; \
		else \
			echo "chromium is not installed and cannot be installed here (needs root and apt-get): tests/e2e will skip"; \
		fi; \
	fi

test: $(STAMP) browser
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
