# The README's two commands. Each creates the virtual environment it needs if missing.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spikeguard demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

# Regenerates docs/bench.md, docs/bench.json and docs/img/bench/ (about 15 min here).
bench: $(STAMP)
	$(VENV)/bin/spikeguard bench --json docs/bench.json --plots docs/img/bench --docs docs/bench.md

clean:
	rm -rf $(VENV) *.egg-info
