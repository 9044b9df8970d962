# mirage-cli: `make demo` runs the compiler on an example, `make test` runs the tests.
# Both install the project (with NVRTC and the CUDA bindings, and its test tools)
# into the current Python first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
BUILD := build

.PHONY: install demo test test-fast golden lint gpu-test clean

install:
	$(PIP) install -q --disable-pip-version-check -e '.[dev]'

demo: install
	@mkdir -p $(BUILD)
	$(PYTHON) -m mirage_cli parse examples/rmsnorm_linear.mir -o $(BUILD)/rmsnorm_linear.ugraph.json
	$(PYTHON) -m mirage_cli run examples/mugraphs/rmsnorm_linear_fused.mir --seed 0 -o $(BUILD)/rmsnorm_linear.out.npz
	$(PYTHON) -m mirage_cli opt examples/rmsnorm_linear.mir -o $(BUILD)/rmsnorm_linear.cu --save-temps $(BUILD)/temps -MD
	$(PYTHON) -m mirage_cli compile $(BUILD)/rmsnorm_linear.cu --arch sm_90 -o $(BUILD)/rmsnorm_linear.cubin
	@echo "wrote $(BUILD)/rmsnorm_linear.{ugraph.json,out.npz,cu,h,mir.d,mir.stamp,cubin} and $(BUILD)/temps/"

# Work stealing: a worker that runs out takes tests queued on the other, so the few
# long tests (NVRTC sweeps, searches) do not leave one core idle at the end.
test: install
	$(PYTHON) -m pytest -m "not gpu" -p no:cacheprovider -n auto --dist worksteal

golden: install
	$(PYTHON) -m mirage_cli.golden

lint:
	$(PYTHON) -m ruff check mirage_cli tests
	$(PYTHON) -m mypy mirage_cli

gpu-test: install
	$(PYTHON) -m pytest -m gpu -p no:cacheprovider

clean:
	rm -rf $(BUILD) .pytest_cache *.egg-info
