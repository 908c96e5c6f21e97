# Developer tasks. `make help` lists them. CI (.ci/run) runs: install, lint, test, wheel-smoke.
PYTHON ?= python3
PYTEST_ARGS ?=
# The suite's test files spread over worker processes (pytest-xdist; a file's tests stay on one
# worker, so its module fixtures are built once). Most tests wait on subprocesses, files or one
# core: on 2 cores, 2 workers take half the time of one. At most 4: each holds torch and models.
# PYTEST_WORKERS=0 runs the suite in this process.
PYTEST_WORKERS ?= auto
# DOCS_ARGS=--reuse: the docs build keeps notebooks already executed from their source (CI: by
# the test suite, just before).
DOCS_ARGS ?=

.PHONY: help install develop fmt lint stubtest test test-rust test-python bench wheel wheel-aarch64 wheel-check sdist sdist-check wheel-smoke first-contact compat-py310 docs docs-test demo mutants clean

help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

install: ## Install kvcouple (editable, release build of the Rust core) with test and dev tools
	$(PYTHON) -m pip install -e ".[dev]"

develop: ## Rebuild the Rust extension in place after Rust changes
	$(PYTHON) -m pip install -e . --no-deps --no-build-isolation

fmt: ## Format Rust and Python
	cargo fmt --all
	ruff format python tests benchmarks scripts .ci
	ruff check --fix python tests benchmarks scripts .ci

lint: ## rustfmt --check, clippy -D warnings, ruff, mypy
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	ruff check python tests benchmarks scripts .ci
	ruff format --check python tests benchmarks scripts .ci
	$(PYTHON) -m mypy python/kvcouple

stubtest: ## Check python/kvcouple/_core.pyi against the built module
	$(PYTHON) -m mypy.stubtest kvcouple._core --allowlist .ci/stubtest-allowlist.txt

test-rust: ## The pure-Rust crates on their own (core, store, fetch)
	cargo test -p kvcouple-core -p kvcouple-store -p kvcouple-fetch

test-python: ## The Python suite, notebooks included (PYTEST_WORKERS processes)
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile $(PYTEST_ARGS)

test: test-rust stubtest test-python ## Everything: cargo test, stub check, pytest (notebooks too)

bench: ## Benchmarks: ratios against peers, measured side by side
	$(PYTHON) benchmarks/bench_kernels.py
	@for b in benchmarks/bench_estimators.py benchmarks/bench_trace.py benchmarks/bench_analysis.py; do \
		if [ -f $$b ]; then echo "== $$b"; $(PYTHON) $$b || exit 1; fi; done

# Portable wheels without docker: zig (the `ziglang` package from PyPI) links against glibc 2.28
# symbols, so the wheels install on RHEL/Rocky 8, Ubuntu 20.04, Debian 10 and newer.
MANYLINUX ?= manylinux_2_28
MATURIN = $(PYTHON) -m maturin
X86_WHEEL = dist/kvcouple-*-abi3-$(MANYLINUX)_x86_64.whl

wheel: ## The abi3 manylinux_2_28 x86_64 wheel in dist/ (maturin --zig, no docker)
	rm -f $(X86_WHEEL)
	$(MATURIN) build --release --zig --compatibility $(MANYLINUX) -o dist

wheel-aarch64: ## The same wheel for aarch64 (needs `rustup target add aarch64-unknown-linux-gnu`)
	rm -f dist/kvcouple-*-abi3-$(MANYLINUX)_aarch64.whl
	$(MATURIN) build --release --zig --compatibility $(MANYLINUX) \
		--target aarch64-unknown-linux-gnu -o dist

wheel-check: ## auditwheel show on every wheel in dist/: fails unless abi3 and manylinux_2_28 or older
	$(PYTHON) .ci/check_wheel.py dist/kvcouple-*.whl

sdist: ## The source distribution in dist/
	rm -f dist/kvcouple-*.tar.gz
	$(MATURIN) sdist -o dist

# sdist-check builds in the repository's target dir: registry crates already built are reused
# (cargo keys them by version and flags); the sdist's own crates, their sources touched, are
# compiled again from the sdist (cargo checks a package's sources relative to its root).
sdist-check: sdist ## Build a wheel from the sdist alone (unpacked outside the repository)
	rm -rf build/sdist && mkdir -p build/sdist
	tar -xzf dist/kvcouple-*.tar.gz -C build/sdist
	find build/sdist -name '*.rs' -exec touch {} +  # newer than the repository's builds: rebuilt
	cd build/sdist/kvcouple-* && CARGO_TARGET_DIR=$(CURDIR)/target $(MATURIN) build --release -o ../wheel
	@ls build/sdist/wheel/kvcouple-*.whl

wheel-smoke: wheel ## Install the wheel in a fresh venv (no torch), check its tag, run both kernels
	$(PYTHON) .ci/check_wheel.py $(X86_WHEEL)
	rm -rf build/venv-smoke && $(PYTHON) -m venv build/venv-smoke
	build/venv-smoke/bin/pip install -q $(X86_WHEEL)
	cd build && venv-smoke/bin/python ../.ci/smoke.py

# The README's two commands as a new user runs them, from the wheel `make wheel` built: a fresh
# venv with exactly `[all]` runs the demo, one with no extra runs the analysis core.
first-contact: ## Fresh venvs from the built wheel: `[all]` runs the demo, no extra runs analyze
	@ls $(X86_WHEEL) >/dev/null 2>&1 || { echo "no wheel in dist/: run make wheel first"; exit 2; }
	PYTHON=$(PYTHON) .ci/first_contact.sh $$(ls $(X86_WHEEL) | head -1)

# The oldest Python we support resolves to zarr 2 and an older xarray: run the torch-free
# suites there against the wheel. Skipped (with a message) where no Python 3.10 is installed.
COMPAT_TESTS = tests/kernels/test_kernels.py tests/kernels/test_coupling.py tests/kernels/test_kernel_errors.py \
	tests/synth/test_synth_exact.py tests/synth/test_synth_pairs.py tests/synth/test_synth_estimators.py \
	tests/analysis/test_analysis_store.py tests/analysis/test_analysis_synthetic.py tests/analysis/test_analysis_plan.py \
	tests/store/test_store_damage.py tests/store/test_store_rechunk.py tests/store/test_store_summary_direct.py tests/kernels/test_tv_only.py \
	tests/store/test_store_integrity.py tests/tracer/test_prompt_files.py tests/tracer/test_memory_footprint.py

compat-py310: wheel ## The wheel and torch-free suites on Python 3.10 (zarr 2)
	@py=$$(ls $$(pyenv root 2>/dev/null)/versions/3.10*/bin/python 2>/dev/null | head -1); \
	[ -n "$$py" ] || py=$$(command -v python3.10 || true); \
	if [ -z "$$py" ] || ! $$py -c "import venv" 2>/dev/null; then \
		echo "no Python 3.10 here: compat-py310 skipped"; exit 0; fi; \
	set -e; rm -rf build/venv-py310; $$py -m venv build/venv-py310; \
	build/venv-py310/bin/pip install -q "$$(ls $(X86_WHEEL))[reference,plots]" \
		pytest hypothesis scipy; \
	build/venv-py310/bin/python -c "import sys, zarr; print('python', sys.version.split()[0], 'zarr', zarr.__version__)"; \
	build/venv-py310/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

# Mutation testing (slow; not in CI). cargo-mutants (`cargo install cargo-mutants`) mutates the
# Rust core and runs its unit tests against each mutant; scripts/mutants.py applies curated
# Python mutants one at a time against the pytest files that should notice. A full Rust run
# takes hours on two cores: scope it, e.g.
#   make mutants MUTANTS_RUST_ARGS="--file rust/core/src/couple.rs --file 'rust/core/src/stats/*'"
MUTANTS_RUST_ARGS ?=
MUTANTS_PY_ARGS ?=

mutants: ## Mutation testing (slow, not in CI): cargo-mutants on rust/core, then scripts/mutants.py
	@command -v cargo-mutants >/dev/null || { echo "needs cargo-mutants: cargo install cargo-mutants"; exit 2; }
	cargo mutants -p kvcouple-core -o target/mutants $(MUTANTS_RUST_ARGS) || true
	@echo "cargo-mutants: caught $$(cat target/mutants/mutants.out/caught.txt 2>/dev/null | wc -l)," \
		"missed $$(cat target/mutants/mutants.out/missed.txt 2>/dev/null | wc -l)," \
		"timeout $$(cat target/mutants/mutants.out/timeout.txt 2>/dev/null | wc -l)," \
		"unviable $$(cat target/mutants/mutants.out/unviable.txt 2>/dev/null | wc -l)" \
		"(missed ones: target/mutants/mutants.out/missed.txt)"
	$(PYTHON) scripts/mutants.py $(MUTANTS_PY_ARGS)

docs: ## The docs site in build/site: executed notebooks, API and CLI reference (mkdocs --strict)
	$(PYTHON) scripts/build_docs.py $(DOCS_ARGS)

docs-test: ## Headless chromium: every page of build/site (figures load, no error cells), the report's text views
	$(PYTHON) -m pytest -q -p no:cacheprovider -rs tests/docs/test_docs_site.py tests/docs/test_report_text_browser.py

demo: ## The main job on the embedded default model
	kvcouple demo

clean:
	rm -rf target dist build .pytest_cache .ruff_cache .hypothesis
