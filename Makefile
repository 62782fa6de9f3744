# The two commands of the README: `make demo` and `make test` (both create .venv first; netpart
# is built with the venv's own setuptools, the build-system's, not in an environment of its own).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
DEMO_OUT ?= out/demo

.PHONY: demo test lint format bench experiments clean

$(BIN)/netpart: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" "setuptools>=77"
	$(BIN)/pip install -q --no-build-isolation -e ".[dev]"
	@touch $@

# The demo plans image-80m over 16 workers, then trains a small locally connected model on the
# bundled digits: 2 model workers x 2 replicas + 2 parameter-server shards (6 processes).
demo: $(BIN)/netpart
	$(BIN)/netpart plan --model image-80m --workers 16 --compare --out $(DEMO_OUT)/plan
	rm -rf $(DEMO_OUT)/train
	$(BIN)/netpart train --model tiny-local --workers 2 --replicas 2 --ps-shards 2 \
		--data digits --steps 300 --eval-every 50 --out $(DEMO_OUT)/train
	@echo "plan report:     $(DEMO_OUT)/plan/report.md"
	@echo "training report: $(DEMO_OUT)/train/report.md"

# pip byte-compiles what it installs but not an editable install's own package: compiled once
# here, the suite's fresh interpreters (torchrun's workers, `python -m netpart` commands)
# do not each compile netpart again where PYTHONDONTWRITEBYTECODE keeps them from caching it.
# Two test processes share the suite (most of its time is spent waiting on processes, sockets
# and deadlines); the tests marked `alone` measure this machine and run after it, by themselves.
test: $(BIN)/netpart
	$(BIN)/ruff check netpart tests benchmarks experiments
	$(BIN)/ruff format --check netpart tests benchmarks experiments
	$(BIN)/python -m compileall -q netpart tests
	$(BIN)/python -m pytest -n 2 --dist worksteal -m "not alone"
	$(BIN)/python -m pytest -m alone

# Regenerates every CSV/JSON/PNG in experiments/results (validate_sim needs root for its
# emulated machines; Figure 3 is drawn for experiments/machines/paper-2012.toml).
experiments: $(BIN)/netpart
	$(BIN)/python experiments/scaling.py
	$(BIN)/python experiments/validate_sim.py
	$(BIN)/python experiments/convergence.py
	$(BIN)/python experiments/ddp_baseline.py

bench: $(BIN)/netpart
	$(BIN)/python benchmarks/plan_bench.py --out benchmarks/results/plan_bench.json

lint format:
	$(BIN)/ruff check --fix netpart tests benchmarks experiments
	$(BIN)/ruff format netpart tests benchmarks experiments

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
