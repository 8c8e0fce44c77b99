# Two commands for a fresh clone: `make demo` and `make test`. Both install first when needed.
# Python 3.12 (megatron-core ships wheels for 3.12+ only since 0.17): the first of python3.12, python3.13,
# python3 on PATH that is, else pyenv's 3.12 (or 3.13).
PYTHON ?= $(shell for p in python3.12 python3.13 python3; do $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
	2>/dev/null && { command -v $$p; exit 0; }; done; \
	ls -d "$$(pyenv root 2>/dev/null)"/versions/3.1[23]*/bin/python3 2>/dev/null | head -1)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The GPU smoke suite (tests/gpu: NCCL, bf16/fp16, TP, uneven batches, distributed optimizer, resume, preemption);
# every test skips cleanly without CUDA.
gpu-check: install
	$(BIN)/python -m pytest -q tests/gpu -rs

.PHONY: gpu-check test-all install demo demo-ctc demo-tdt tts-demo salm-demo test test-tp lint format bench clean

install: $(STAMP)

# Debian packages of the built-in corpus's synthesisers (Flite, Festival and its voices) and of tcmalloc.
APT_PACKAGES = flite festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts libtcmalloc-minimal4

# The CPU demos' environment: tcmalloc preloaded where it is installed (its training steps are faster than glibc's
# malloc's, speechtrain.backends.cpu); without it LD_PRELOAD is empty and nothing changes.
CPU_RUN = OMP_WAIT_POLICY=PASSIVE LD_PRELOAD="$$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1)" \
	TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=1099511627776

$(STAMP): pyproject.toml
	@echo "make: installing the pinned packages into $(VENV) (and, as root, the built-in corpus's Debian packages)"
	@test -n "$(PYTHON)" || { echo "make: speechtrain needs Python >= 3.12 (megatron-core 0.19); none found on PATH" \
		"or in pyenv. Set PYTHON=/path/to/python3.12."; exit 1; }
	@# a venv of an older Python (speechtrain supported 3.11 until megatron-core 0.16) is made again
	@$(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || \
		{ rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	@# uv installs what pip would (same resolution), faster, and `make demo` trains for the difference; where uv
	@# cannot (no wheel for this platform, an index only pip.conf names) pip does. --compile-bytecode writes the .pyc
	@# files pip would, so that no new process compiles torch, lightning and megatron first.
	@$(BIN)/python -m pip install --quiet --upgrade pip uv || true
	@$(BIN)/python -m uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[dev]' || \
		$(BIN)/python -m pip install --quiet --no-cache-dir -e '.[dev]'
	@# Festival (three voices) reads part of the built-in corpus, Flite its held-out sets (and tcmalloc, above).
	@dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq $(APT_PACKAGES) >/dev/null 2>&1 || \
		  { apt-get update -qq && apt-get install -y -qq $(APT_PACKAGES); }; }; } \
		|| echo "note: the built-in corpus needs apt-get install $(APT_PACKAGES)"
	@touch $(STAMP)

# The ASR demo: a hybrid TDT-CTC Conformer (asr_train_hybrid.yaml) on 2 cores, greedy WER and beam + LM beside it.
# It builds what the recipe reads (corpora, tokenizer, LM: prepare_only=true), then trains for what is left of its
# wall-clock budget (a slow machine trains less rather than run over); the learning-rate schedule decays over that.
# Its only validation is the closing one (check_val_every_n_epoch=1000: in-fit ones would cost training time for
# figures the closing gives anyway), so it writes its archive and last.ckpt, not checkpoints ranked by a metric.
# When make started (seconds since the epoch).
DEMO_START := $(shell date +%s)
# The demo's wall-clock budget from DEMO_START, in seconds.
DEMO_WALL_S ?= 1765
# Seconds of the budget kept for the start-up, the closing validation and the report.
DEMO_CLOSING_S ?= 85
# The least training time in seconds, even if the budget is then missed.
DEMO_MIN_TRAIN_S ?= 600
demo: install
	@echo "make demo: 1/3 building what the recipe reads: the built-in speech corpus (synthesised on first use:" \
		"minutes, with progress lines), a BPE tokenizer and a word LM fitted on its transcripts"
	$(CPU_RUN) $(BIN)/python examples/asr_train.py --config-name asr_train_hybrid prepare_only=true
	@left=$$(( $(DEMO_START) + $(DEMO_WALL_S) - $(DEMO_CLOSING_S) - $$(date +%s) )); \
	if [ $$left -lt $(DEMO_MIN_TRAIN_S) ]; then \
		echo "make demo: $$left s left of its $(DEMO_WALL_S) s budget; training $(DEMO_MIN_TRAIN_S) s anyway"; \
		left=$(DEMO_MIN_TRAIN_S); fi; \
	echo "make demo: 2/3 training a hybrid TDT-CTC recogniser on 2 processes for $$left s" \
		"($$(( $$(date +%s) - $(DEMO_START) )) s since make started), then decoding every set"; \
	echo "+ python examples/asr_train.py --config-name asr_train_hybrid name=asr_demo trainer.devices=2" \
		"model.train_ds.batch_duration=30 trainer.max_time={seconds: $$left} trainer.check_val_every_n_epoch=1000"; \
	$(CPU_RUN) $(BIN)/python examples/asr_train.py --config-name asr_train_hybrid name=asr_demo \
		trainer.devices=2 model.train_ds.batch_duration=30 "trainer.max_time={seconds: $$left}" \
		trainer.check_val_every_n_epoch=1000
	@echo "make demo: 3/3 recording the run's figures in results/demo.jsonl and RESULTS.md"
	$(BIN)/python benchmarks/results.py from-run "$$(ls -td speechtrain_experiments/asr_demo/*/ | head -1)" \
		--wall-s $$(( $$(date +%s) - $(DEMO_START) ))

# The same data and encoder with CTC alone (asr_train.yaml), for its recipe's trainer.max_time.
demo-ctc: install
	$(CPU_RUN) $(BIN)/python examples/asr_train.py trainer.devices=2 model.train_ds.batch_duration=30

# The TDT transducer demo: the CTC demo's data, tokenizer, encoder and budget, with a TDT decoder.
demo-tdt: install
	$(CPU_RUN) $(BIN)/python examples/asr_train.py --config-name asr_train_tdt trainer.devices=2 \
		model.train_ds.batch_duration=30

# The TTS demo (2 cores, its recipe's trainer.max_time); judged by the newest ASR demo archive when there is one.
tts-demo: install
	ASR=$$(ls -t speechtrain_experiments/asr_demo/*/asr_demo.stm 2>/dev/null | head -1); \
	$(CPU_RUN) $(BIN)/python examples/tts_train.py trainer.devices=2 model.train_ds.batch_duration=30 \
		asr_model=$${ASR:-null}

# The SALM demo (2 cores): an ASR encoder (skipped with ASR=<archive>), a tiny GPT pretrained on corpus text, then
# SALM and its evaluation on the test split.
salm-demo: install
	set -e; ASR=$${ASR:-}; \
	if [ -z "$$ASR" ]; then \
		$(CPU_RUN) $(BIN)/python examples/asr_train.py trainer.devices=2 model.train_ds.batch_duration=30 \
			trainer.max_time=00:00:16:00 name=salm_asr model.train_ds.manifest_filepath=builtin:espeak/train \
			model.interctc.self_conditioning=false model.encoder.time_reduce_idx=-1 model.encoder.time_recovery_idx=-1 \
			'model.validation_ds.manifest_filepath=[builtin:espeak/dev,builtin:espeak/test]'; \
		ASR=$$(ls -t speechtrain_experiments/salm_asr/*/salm_asr.stm | head -1); \
	fi; \
	$(CPU_RUN) $(BIN)/python examples/gpt_pretrain.py trainer.devices=2; \
	LLM=$$(ls -td speechtrain_experiments/gpt_pretrain/*/hf | head -1); \
	$(CPU_RUN) $(BIN)/python examples/salm_train.py trainer.devices=2 model.llm.hf_path=$$LLM \
		model.perception.asr_model=$$ASR

# The default suite (CI): everything but the tests marked slow (real fine-tunes of imported NeMo checkpoints, the
# batch-size search). `make test-all` runs those too.
test: install lint
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not slow"

test-all: install lint
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

# Every example script at TP=1 and TP=2 (2 gloo processes), tiny sizes: losses, metrics, archives, exports and
# generated outputs equal (the default suite runs gpt_pretrain's).
test-tp: install
	SPEECHTRAIN_TP_MATRIX=all OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q tests/test_examples_tp.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python benchmarks/import_time.py
	$(BIN)/python benchmarks/asr_demo.py
	$(BIN)/python benchmarks/bridge_overhead.py

# RESULTS.md regenerated from the records in results/*.jsonl.
.PHONY: results
results: install
	$(BIN)/python benchmarks/results.py render

clean:
	rm -rf $(VENV) speechtrain_experiments .pytest_cache .ruff_cache
