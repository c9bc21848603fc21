# Two commands on a fresh machine:  `make demo`  (install, then train + evaluate the demo)  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.deform_plugin_installed

.PHONY: install demo test clean

install: $(STAMP)

# --system-site-packages: a torch (or a compiled mmcv) already on the machine is kept and used as it is.
$(STAMP): setup.py requirements/runtime.txt requirements/tests.txt Makefile deform_plugin/integration/mmcv_lite.py
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -r requirements/runtime.txt -r requirements/tests.txt
	@# mmcv with compiled ops, where present, is used as it is; otherwise mmcv-lite (seconds, no compiler).
	$(PY) deform_plugin/integration/mmcv_lite.py compiled-ops || $(PIP) install mmcv-lite==2.1.0
	@# mmdet's panoptic loading and metric import `panopticapi`, which PyPI has only as panopticapi-lite (the same
	@# module); its metadata pins numpy<2, which the module does not need: installed without dependencies.
	$(PIP) install --no-deps panopticapi-lite==0.2.0
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PY) -c "import deform_plugin, mmdet.models; print('deform_plugin', deform_plugin.__version__, 'ready')"
	touch $(STAMP)

demo: install
	$(PY) tools/demo.py

# OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning, which matters on a shared 2-core machine.
# -n: one pytest worker per core (pytest-xdist); TEST_WORKERS=0 runs the tests in one process. --dist loadgroup:
# a module marked xdist_group runs on one worker, so that its module-scoped fixture (a multi-process run) runs once.
TEST_WORKERS ?= auto
test: install
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup

clean:
	rm -rf $(VENV) work_dirs .pytest_cache
