# Every target sets up what it needs on a fresh clone. torch is installed first, pinned to the
# CPU build on disk, so that no dependency resolves a multi-GB CUDA build of torch.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Lightning, for the comparison in `make bench`, lives in a virtual environment of its own so
# that it never shares a dependency with dream_trainer.
BENCH_VENV ?= .bench-venv
BENCH_STAMP := $(BENCH_VENV)/.installed
TORCH_VERSION ?= 2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test docs bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[dev,metrics,wandb,tensorboard,docs,hf,ft,float8,s3,lora]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/digits.py

# The Lightning environment is built for the tests too, so the Lightning side of the
# benchmarks cannot rot unnoticed; the two environments are built side by side (about 35 s
# less than one after the other). The suite runs in two workers, a test file at a time each
# (its module fixtures run once): in-process tests use one thread and launches wait on
# process start-up, so one worker left about a third of the 2 cores idle.
test:
	$(MAKE) --jobs=2 $(STAMP) $(BENCH_STAMP)
	DREAM_BENCH_LIGHTNING_PYTHON=$(BENCH_VENV)/bin/python $(PY) -m pytest -q --durations=25 \
		--numprocesses=2 --dist=loadfile

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

$(BENCH_STAMP):
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BENCH_VENV)/bin/python -m pip install --quiet lightning
	touch $(BENCH_STAMP)

# Every benchmark, side by side with a hand-written loop and Lightning; writes
# benchmarks/results/results.{json,md}. Takes about half an hour on 2 CPU cores.
bench: $(STAMP) $(BENCH_STAMP)
	$(PY) -m benchmarks --lightning-python $(BENCH_VENV)/bin/python

clean:
	rm -rf $(VENV) $(BENCH_VENV) build site *.egg-info
