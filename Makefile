# The README's two commands: `make run` (the main job, `cokit demo`) and `make test`.
# Both create .venv on first use: torch==2.13.0 (CPU build on our machines), triton, cokit
# with its dev extra (every optional library the tests use: torchft and its lighthouse too).
# `make test-triton36` builds .venv36, .venv with the oldest supported triton (3.6.0) in front.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.cokit-installed
VENV36 := .venv36
STAMP36 := $(VENV36)/.cokit-installed
PYTEST_FAST := -m "not slow and not notebook"
# The suites run on JOBS pytest workers (pytest-xdist), each test file on one worker (its module
# fixtures run once). Much of the suite waits on spawned ranks, timeouts and subprocesses.
JOBS ?= 2
PYTEST_PAR := -n $(JOBS) --dist loadfile

.PHONY: run test test-fast test-triton36 lint format typecheck docs info clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# .venv36 is .venv with triton 3.6.0 in front: it installs triton alone and reads every other
# package (torch, cokit's editable install, the test tools) from .venv's site-packages through
# a .pth file, instead of installing them all a second time (about 80 s of CI).
$(STAMP36): $(STAMP)
	rm -rf $(VENV36)
	$(PYTHON) -m venv $(VENV36)
	$(VENV36)/bin/python -m pip install -q --no-deps triton==3.6.0
	main=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  own=$$($(VENV36)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  echo "import site; site.addsitedir('$$main')" > "$$own/zz-cokit-main-venv.pth"
	$(VENV36)/bin/python -c "import triton, torch, cokit; assert triton.__version__ == '3.6.0', triton.__version__"
	touch $(STAMP36)

# Each `make run` gets its own results folder: a second run never replaces (or is refused by) the first.
# The demo writes its telemetry there; the dashboard (one offline HTML page) is drawn from it
# and its path printed last.
run: $(STAMP)
	out=results/demo/$$(date +%Y%m%d-%H%M%S) && $(BIN)/cokit demo --out $$out && $(BIN)/cokit dashboard $$out

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_PAR)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_PAR) $(PYTEST_FAST)

# The suite (all but the notebooks) on triton 3.6, the GPU image's version: the kernels under
# the interpreter, the compile-only builds for sm_80/sm_90/gfx942, and the front ends that run
# them (DeMo, SparseLoCo, the DDP hook, the overlap schedules and streams, the CLI).
# TRITON_FREE run no Triton code (torch path, gloo, a browser) or only what the files above
# already run under 3.6: network, faults, policies, timing, telemetry, dashboard, plan,
# calibration, docs, packaging, layering, launch, settings and peer checks, the tuner and
# sweeps, the SparseLoCo options and its overlapped sync, Dion, cokit on torchft and its benchmark, the time to
# target, the decomposition, the hook's failures and the exit stress. Once, on the main suite's
# triton, is enough.
TRITON_FREE = tests/test_netbed.py tests/test_faults.py tests/test_simulated_latency.py \
	tests/test_policy_demo.py tests/test_resilience_bench.py tests/test_outputs.py \
	tests/test_comm_timing.py tests/test_telemetry.py tests/test_dashboard.py \
	tests/test_fsdp.py tests/test_hierarchy.py tests/test_examples.py tests/test_hook_state.py \
	tests/test_checkpoint.py tests/test_no_surprises.py tests/test_exchange_scaling.py \
	tests/test_update_rules.py tests/test_precision.py tests/test_workloads.py \
	tests/test_validate_compression.py tests/test_reliability_matrix.py tests/test_telemetry_export.py \
	tests/test_integrations_accelerate.py tests/test_integrations_hf.py tests/test_integrations_lightning.py \
	tests/test_plan.py tests/test_validate_on.py tests/test_docs.py tests/test_cpu_step_paths.py \
	tests/test_sparseloco_sync_paths.py tests/test_transfer_protocol.py tests/test_dion.py \
	tests/test_policy.py tests/test_policy_no_regret.py tests/test_comm_priority.py \
	tests/test_demo_baseline.py tests/test_doc_citations.py tests/test_no_ticket_refs.py tests/test_grad_scaler.py \
	tests/test_hook_nonfinite.py tests/test_launch.py tests/test_layering.py tests/test_packaging.py \
	tests/test_overlap_metrics.py tests/test_overlap_sweep.py tests/test_overlap_training.py \
	tests/test_overlap_tuner.py tests/test_peer_check.py tests/test_settings_check.py \
	tests/test_sparseloco_adaptive_k.py tests/test_sparseloco_options.py tests/test_write_failures.py \
	tests/test_plot_extras.py tests/test_ft.py tests/test_hook_failures.py tests/test_exit_stress.py \
	tests/test_ft_scenarios.py tests/test_sparseloco_undo.py tests/test_ft_demo.py tests/test_ft_demo_heal.py \
	tests/test_ft_heal.py tests/test_ft_bench.py tests/test_time_to_target.py tests/test_decompose.py \
	tests/test_sparseloco_overlap.py
test-triton36: $(STAMP36)
	$(VENV36)/bin/python -m pytest -q --durations=15 $(PYTEST_PAR) -m "not notebook" $(addprefix --ignore=,$(TRITON_FREE))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: $(STAMP)
	$(BIN)/mypy

# The docs site (mkdocs, material theme, API pages from the docstrings) into site/, ignored by
# git; --strict fails on a broken link, anchor or docstring reference.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

info: $(STAMP)
	$(BIN)/cokit info

clean:
	rm -rf $(VENV) $(VENV36) .pytest_cache .mypy_cache .ruff_cache
