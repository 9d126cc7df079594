# Every target sets up what it needs on a fresh clone. torch is installed first, pinned to the
# CPU build on disk, so that no dependency resolves a multi-GB CUDA build of torch.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[dev,metrics,wandb,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/digits.py

test: $(STAMP)
	$(PY) -m pytest -q

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build site *.egg-info
