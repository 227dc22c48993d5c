# Asteroid: `make run` starts the site, `make test` runs the whole suite; both set up .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint venv browser agent gpu-check

# The stamp is newer than requirements.txt once its packages are installed: pip runs only after it changes.
$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt | $(PY)
	$(PY) -m pip install -r requirements.txt
	@echo "compiling the planner's search and the simulator (numba; once, about 20 s)"
	$(PY) -c "from engine.planners import kernel; kernel.warm()"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(PY) -m webapp.startsite

# A board's agent: `make agent SERVER=https://SITE:8000 TOKEN=ENROLLMENT_TOKEN CA=sha256:...`, the line the site's
# *Add device* page shows (TOKEN only the first time; EMULATE=nano presents this host as a Nano, STATE=FILE keeps the
# credential elsewhere). It runs in .venv-agent: requirements-agent.txt only (nothing of the site), in a venv that
# sees the system's packages, so a Jetson's JetPack torch (CUDA) is used, never replaced (workers/agentreqs.py).
# AGENT_PYTHON is the Python that torch is installed for (JetPack 6: the system's python3). A checkout whose .venv
# is already set up (the site's own host) runs the agent there instead: it holds everything the agent needs.
AGENT_PYTHON ?= python3
AGENT_VENV ?= $(if $(wildcard $(STAMP)),$(VENV),.venv-agent)
AGENT_PY := $(AGENT_VENV)/bin/python

.venv-agent/bin/python:
	$(AGENT_PYTHON) -m venv --system-site-packages .venv-agent

.venv-agent/.installed: requirements-agent.txt workers/agentreqs.py | .venv-agent/bin/python
	.venv-agent/bin/python workers/agentreqs.py requirements-agent.txt > .venv-agent/requirements.txt
	.venv-agent/bin/python -m pip install -r .venv-agent/requirements.txt
	touch .venv-agent/.installed

agent: $(AGENT_VENV)/.installed
	@if [ -z "$(SERVER)" ]; then \
		echo "error: make agent needs SERVER=http://SITE:PORT (and TOKEN=... the first time): the site's Add device page shows the line" >&2; \
		exit 2; \
	fi
	@exec $(AGENT_PY) -m workers.agent --server "$(SERVER)" $(if $(TOKEN),--token "$(TOKEN)") \
		$(if $(EMULATE),--emulate "$(EMULATE)") $(if $(STATE),--state "$(STATE)") $(if $(CA),--ca "$(CA)")

# The GPU check (docs/benchmarks.md): on a machine with an NVIDIA GPU and a CUDA build of torch, one line per result,
# under 8 minutes. Without a GPU it says so and fails.
gpu-check: $(STAMP)
	$(PY) -m engine bench gpu

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
