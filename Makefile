# kimilab — the two commands a newcomer needs are `make book` and `make test`.
# Both create .venv on first use and reinstall only when pyproject.toml changes.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
PARITY := $(VENV)/.installed-parity
# One BLAS thread per process: the book's matrices are small, and on a shared 2-core machine
# a multithreaded BLAS stalls for milliseconds at a time (chapters and nbval kernels inherit it).
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: setup book html student grade classroom launch site experiment results test lint fuzz lab sync bench parity clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "kimilab needs Python >= 3.10"'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

# Execute every chapter in order, store outputs, save figures/, render _build/html/.
book: $(STAMP)
	$(BIN)/python -m kimilab book

# The web edition from the stored notebooks (no execution, no network): the teacher's site in
# _build/html/ and the student's (no solutions) in _build/html-student/.
html: $(STAMP)
	$(BIN)/python -m kimilab html

# The student bundle: student/ and student.zip (notebooks without solutions or outputs, the package
# without the answer checkers, public sanity checks, the data, a Makefile). No answers in it.
student: $(STAMP)
	$(BIN)/python -m kimilab student

# Grade answered student notebooks: make grade DIR=submissions/ [OUT=grades.csv] [GRADE_JOBS=N] executes
# each one (with the teacher's checkers) and writes one CSV row per notebook and exercise, then a gradebook
# (a row per student) and a Canvas import beside it.
grade: $(STAMP)
	@test -n "$(DIR)" || { echo "make grade: DIR= is required, e.g. make grade DIR=submissions/" >&2; exit 2; }
	$(BIN)/python -m kimilab grade $(DIR) --out $(or $(OUT),grades.csv) $(if $(GRADE_JOBS),--jobs $(GRADE_JOBS))

# The book's experiment (chapter 11): results/part_a.{json,md} (reduced model, CPU) and
# results/part_b.{json,md} (48B sizes, fleet simulator on the real traces), at the size chapter 11
# stores (about two minutes on 2 cores; ARGS="--scale full" runs every variant on the whole hour).
experiment: $(STAMP)
	$(BIN)/python -m kimilab experiment --out results $(ARGS)

# The chapters' long computations are stored in data/results/ (kimilab/stored.py): recompute every one
# from this source and fail if any number differs from its file (CI runs it; minutes).
results: $(STAMP)
	$(BIN)/python -m kimilab results --check --jobs 2

# The linter over the package, the tests, the benchmarks and the chapters' sources (pyproject.toml
# [tool.ruff] says which rules and why); CI runs it before the tests.
lint: $(STAMP)
	$(BIN)/ruff check kimilab tests bench chapters/*.py

# Unit + property tests and strict nbval over every executed chapter, on every core (pytest-xdist; a
# notebook's cells stay together on one worker: --dist loadfile). JOBS=1 runs them in one process.
JOBS ?= auto
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile -m "not classroom and not network and not site" tests chapters/*.ipynb $(NBVAL)

# The property tests of pool, prefix cache, engine, fleet, speculative decoding, context
# parallelism and the command line (random argv on malformed traces) with a random seed (printed)
# and FUZZ_FACTOR (default 10) times the examples `make test` runs; about 4 minutes on 2 cores
# (budget: 10). FUZZ_SEED=N repeats a run.
FUZZ_TESTS := tests/test_pool.py tests/test_paged.py tests/test_radix.py tests/test_prefix.py tests/test_host_tier.py \
	tests/test_runs.py tests/test_sim.py tests/test_engine.py tests/test_engine_tensor.py \
	tests/test_fleet.py tests/test_disagg.py tests/test_engine_spec.py tests/test_spec.py tests/test_cp.py tests/test_segments.py tests/test_cp_layouts.py \
	tests/test_cli_fuzz.py
fuzz: $(STAMP)
	@seed=$${FUZZ_SEED:-$$($(BIN)/python -c 'import secrets; print(secrets.randbelow(2**32))')}; \
	echo "make fuzz: hypothesis seed $$seed, $${FUZZ_FACTOR:-10}x the examples"; \
	KIMILAB_FUZZ_FACTOR=$${FUZZ_FACTOR:-10} $(BIN)/python -m pytest -q -m hypothesis $(FUZZ_TESTS) \
		--hypothesis-profile=fuzz --hypothesis-seed=$$seed \
	|| { echo "make fuzz failed with seed $$seed: FUZZ_SEED=$$seed make fuzz repeats it"; exit 1; }

# Every notebook of a fresh student bundle runs, on the bundle's own kimilab, up to its first
# exercise and stops there (executes every chapter again, so not part of make test); and the
# grader faces every known forgery and class-breaking notebook (tests/test_redteam.py).
classroom: $(STAMP)
	$(BIN)/python -m pytest -q -m classroom tests/test_classroom.py tests/test_redteam.py

# The web edition's tests: both sites built from the stored notebooks, read as files and in headless Chromium.
site: $(STAMP)
	$(BIN)/python -m pytest -q -m site tests/test_site.py

# Where else the book opens: the Colab setup cell, the browser's limits (also in make test), and the
# Binder environment resolving from the package index in a clean virtual environment (needs the network).
launch: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_launch.py

lab: $(STAMP)
	$(BIN)/jupyter lab chapters/

# Pair every chapters/NN_slug.py with its .ipynb (the .py is the reviewed source).
sync: $(STAMP)
	$(BIN)/jupytext --sync chapters/[0-9][0-9]_*.py

# Benchmarks compare implementations with both cores, as the issues specify.
bench: export OPENBLAS_NUM_THREADS := 2
bench: export OMP_NUM_THREADS := 2
bench: $(STAMP)
	$(BIN)/python bench/run.py

# KDA parity with the flash-linear-attention reference (CPU torch from the local wheel).
$(PARITY): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[dev,parity]'
	@touch $@

parity: $(PARITY)
	$(BIN)/python -m pytest -q -m parity tests

clean:
	rm -rf _build figures student student.zip grades.csv results .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
