# The README's two commands. Each creates the virtual environment it needs if missing.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Every install pins exactly what CI tests (constraints.txt: the lock); pyproject.toml
# holds only the supported ranges.
PIP := $(VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt
# torchtitan for spikeguard.integrations.titan_* and its tests: installed without its
# declared dependencies (datasets, wandb, tensorboard, ...: its trainer's, not its MoE
# model's), with only what `import torchtitan.models` needs. triton is imported at module
# level by its token dispatcher (a 286 MB wheel; never run on CPU). Their versions, as every
# other's, come from constraints.txt (the `titan` extra in pyproject.toml holds the ranges).
TITAN_PKGS := torchtitan spmd_types triton tyro docstring_parser typeguard torchdata
# What torchtitan's Trainer imports at module level (`-m torchtitan.train`, its tests in
# tests/integrations/test_integrations_titan_train.py): its metrics' tensorboard, its data
# loader's datasets (torchdata above, --no-deps: it would pull another torch); with their
# own dependencies. About 25 s on a fresh install here.
TITAN_TRAINER_PKGS := tensorboard datasets

.PHONY: demo test test-fast bench bench-pp clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps $(TITAN_PKGS)
	$(PIP) $(TITAN_TRAINER_PKGS)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spikeguard demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

# The edit-run loop's subset: one process, nothing over ~5 s (markers: tests/conftest.py).
# CI runs `make test`, everything.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -m "not slow and not multiprocess and not gpu"

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
