# hpctp: the two commands a newcomer runs (see README):
#   make demo   -- create .venv, install everything, run the main job on 4 ranks:
#                  simulate -> train the surrogate -> evaluate -> plot (apps/pipeline.py)
#   make test   -- create .venv if needed, run the whole test suite on 1 (two xdist workers), 2, 3, 4 and 6 ranks, then
#                  the IO tests again with h5py on parallel HDF5 (MPI-IO; tests/run_mpio.sh), then the
#                  jobs/ scripts under a one-node Slurm started for it (as root; tests/run_slurm.sh); prints
#                  the wall time of each leg and the total (tests/make_test.sh)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 4
# every MPI run is killed after this many seconds, so a deadlock fails fast
MPI_TIMEOUT ?= 900

export OMP_NUM_THREADS ?= 1

MPIEXEC_ENV := MPIR_CVAR_ENABLE_HEAVY_YIELD=1

.PHONY: install demo core-demo capi test test-main test-mpio lint docs clean

$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[mpich,test,apps]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(MPIEXEC_ENV) timeout $(MPI_TIMEOUT) $(VENV)/bin/mpiexec -n $(NP) $(PY) -m apps.pipeline

core-demo: install
	$(MPIEXEC_ENV) timeout $(MPI_TIMEOUT) $(VENV)/bin/mpiexec -n $(NP) $(PY) -m hpctp demo

# test = test-main + test-mpio + the Slurm leg, with .venv-mpio built in the background while test-main runs
# (about 16-18 minutes on 2 cores from a fresh clone; the first on a machine also compiles h5py, about 3 minutes of
# one core, in the background); which files run on 3, 4 and 6 ranks: tests/run_all.sh
test:
	MAKE="$(MAKE)" bash tests/make_test.sh

test-main: install
	bash tests/system_deps.sh
	bash tests/run_all.sh

# builds .venv-mpio once (mpi4py's wheel + h5py compiled against the system's parallel HDF5; apt-get as root)
test-mpio:
	bash tests/run_mpio.sh

# style, types and layers (CI runs it after `make test`): ruff lint + format check over the tree, mypy on
# the library, the apps and the benchmarks, and import-linter's contracts (setup.cfg [importlinter]): every
# room of hpctp imports only the rooms below it, function-body imports included, so no cycle can form; then
# tools/code_map.py prints the largest folder's share of hpctp's lines (fails above 20%) and the guide's pages
lint: install
	$(PY) -m pip install -q -c constraints.txt -e ".[lint]"
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m mypy hpctp apps benchmarks
	$(VENV)/bin/lint-imports
	$(PY) tools/code_map.py

# the user guide (its scripts in examples/guide/ run under mpiexec: docs/_ext/hpctp_guide.py) and the API reference
# (Sphinx + numpydoc) into build/docs/html; warnings are errors, and so is a failing guide script (CI runs it)
docs: install
	$(PY) -m pip install -q -c constraints.txt -e ".[docs]"
	$(VENV)/bin/sphinx-build -E -W --keep-going -q -j auto -b html docs build/docs/html

capi: install
	cmake -S . -B build/capi -DPython3_EXECUTABLE=$(abspath $(PY)) && cmake --build build/capi -j

clean:
	rm -rf $(VENV) .venv-mpio build *.egg-info
