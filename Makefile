# The README's two commands. Each creates the virtual environment it needs if missing.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-pp clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spikeguard demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

# Regenerates docs/bench.md, docs/bench.json and docs/img/bench/ (tracked: --overwrite).
bench: $(STAMP)
	$(VENV)/bin/spikeguard bench --json docs/bench.json --plots docs/img/bench --docs docs/bench.md \
		--overwrite

# The same harness under a pipeline, PP=2 x EP=2 on 4 processes: docs/bench_pp.md,
# docs/bench_pp.json and docs/img/bench_pp/ (tracked: --overwrite).
bench-pp: $(STAMP)
	$(VENV)/bin/spikeguard bench --pp 2 --ep 2 --steps 48 --batch-size 4 --segments 3 \
		--checkpoint-every 8 --spike-prob 0.08 --json docs/bench_pp.json \
		--plots docs/img/bench_pp --docs docs/bench_pp.md --overwrite

clean:
	rm -rf $(VENV) *.egg-info
