# Set-up finds Python >= 3.12 itself (the machine's python3 is 3.11; pyenv has 3.12) and keeps
# everything in .venv/ at the repository root.
VENV := .venv
PY := $(VENV)/bin/python
PYTHON_CANDIDATES := python3.12 python3.13 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) \
	$(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13) python3
EXTRAS ?= model,serve,dev,notebooks

.PHONY: demo test test-slow test-gpu lint clean notebooks notebooks-sync

$(VENV)/.installed: pyproject.toml
	@py=""; for c in $(PYTHON_CANDIDATES); do \
	  if $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then py=$$c; break; fi; \
	done; \
	if [ -z "$$py" ]; then echo "error: Python >= 3.12 not found (tried: $(PYTHON_CANDIDATES)); install it, e.g. 'pyenv install 3.12'" >&2; exit 1; fi; \
	echo "using $$py"; \
	rm -rf $(VENV) && $$py -m venv $(VENV) && \
	$(PY) -m pip install --quiet --upgrade pip && \
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	@touch $@

demo: $(VENV)/.installed
	$(PY) -m weaver_jax.demo

# --reruns: a test whose worker crashed runs once more (a safety net: the crash seen in nearly every run, a
# worker past vm.max_map_count inside XLA, is prevented in tests/conftest.py); failures are never rerun
test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --durations=15 -m "not gpu and not slow" --reruns 1 --only-rerun "crashed while running"

test-slow: $(VENV)/.installed  # the real Qwen2.5-Coder-0.5B GGUF end to end (downloads 491 MB once; minutes)
	$(PY) -m pip install --quiet -e '.[$(EXTRAS),slow]'
	$(PY) -m pytest -q -m slow --durations=5

test-gpu:  # on a machine with a GPU and jax[cuda] (the device tool: `make test-gpu` there); logs in $$OUT
	bash tests/gpu.sh

notebooks: $(VENV)/.installed  # all four, full settings (~5 min on a 2-core CPU, the train notebook ~3.5)
	$(PY) notebooks/run.py --all

notebooks-sync: $(VENV)/.installed  # regenerate every .ipynb from its .py (the source of truth)
	$(PY) notebooks/run.py --sync

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
