# hpctp: the two commands a newcomer runs (see README):
#   make demo   -- create .venv, install everything, run the main job on 4 ranks
#   make test   -- create .venv if needed, run the whole test suite on 1, 2, 3 and 4 ranks
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 4
# every MPI run is killed after this many seconds, so a deadlock fails fast
MPI_TIMEOUT ?= 900

export OMP_NUM_THREADS ?= 1

.PHONY: install demo test test-serial test-mpi clean

$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[mpich,test]"
	touch $@

install: $(VENV)/.installed

demo: install
	timeout $(MPI_TIMEOUT) $(VENV)/bin/mpiexec -n $(NP) $(PY) -m hpctp demo

test: install
	bash tests/run_all.sh

clean:
	rm -rf $(VENV) build *.egg-info
