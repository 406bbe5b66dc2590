# The two commands a newcomer needs: `make demo` and `make test`.
# Each creates its own virtual environment in .venv on first use.
PYTHON ?= python3
# The CPU build of torch is enough for the demo and the tests; any torch>=2.11 runs draftline.
# On GPU: pip install -e ".[gpu]", plus ".[hybrid]" (flash-linear-attention) for Qwen3.5/3.6 targets.
TORCH_SPEC ?= torch==2.13.0
SPECULATORS := "speculators==0.9.0" "hs-connectors==0.9.0" "loguru==0.7.3" "openai==3.57.0" "sniffio==1.3.1" \
	"datasets==5.1.0" "multiprocess==0.70.19" "dill==0.4.1" "xxhash==4.1.0" "pandas==3.1.1"
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

# The demo needs draftline and torch; the tests add pytest and the references they compare against.
$(BIN)/.demo: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	touch $@

$(BIN)/.installed: $(BIN)/.demo
	$(BIN)/pip install -q -e ".[test]"
	# The official DFlash inference code is the reference the tests compare against; SpecForge's code is the
	# reference for the D-PACE and DSpark objectives (its own dependencies pin CUDA builds and servers).
	$(BIN)/pip install -q --no-deps "dflash==0.1.0" "specforge==0.2.0"
	# A third-party consumer of the export format: speculators' DFlash converter, with only what its
	# import needs (its full install pins torchvision/torchaudio and an older transformers).
	$(BIN)/pip install -q --no-deps $(SPECULATORS)
	# An older transformers (before its cache rewinds linear-attention layers), beside the environment, not in it:
	# tests/evaluate/test_old_transformers.py runs the decoder's own rollback on it in a subprocess.
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/compat/transformers-5.24.0 "transformers==5.24.0"
	touch $@

# The demo's 9.5 minutes count from the moment `make demo` was typed: the set-up's time is theirs too.
DEMO_START := $(shell date +%s)

demo: $(BIN)/.demo
	$(BIN)/draftline demo --minutes 9.5 --since $(DEMO_START)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo-run
