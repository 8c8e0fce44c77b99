# Two commands for a fresh clone: `make demo` and `make test`. Both install first when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The GPU smoke suite (tests/gpu: NCCL, bf16/fp16, TP, uneven batches, distributed optimizer, resume, preemption);
# every test skips cleanly without CUDA. Under 5 minutes on one node.
gpu-check: install
	$(BIN)/python -m pytest -q tests/gpu -rs

.PHONY: gpu-check test-all install demo demo-ctc demo-tdt tts-demo salm-demo test test-tp lint format bench clean

install: $(STAMP)

APT_PACKAGES = flite festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts libtcmalloc-minimal4

# The CPU demos run under tcmalloc (Debian's libtcmalloc-minimal4, installed with the packages above) where it is
# installed: faster training steps than glibc's malloc even with the Trainer's settings for it
# (speechtrain.common.memory; `benchmarks/asr_train_speed.py --recipe ... --preload`, README Results). Without it
# LD_PRELOAD is empty and nothing changes.
CPU_RUN = OMP_WAIT_POLICY=PASSIVE LD_PRELOAD="$$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1)" \
	TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=1099511627776

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# uv installs the same packages as pip (same resolution: `uv pip freeze` = `pip freeze` here) in ~16 s from an
	@# empty cache where pip took ~85 s (5.5 GB of torch and its CUDA libraries), and `make demo` trains for the
	@# difference. Where uv cannot (no wheel for this platform, an index only pip.conf names) pip does it.
	@# --compile-bytecode (~15 s): without the .pyc files pip writes, every new process (the test suite starts
	@# hundreds) imported torch, lightning and megatron 5 s slower, and the suite took 15.5 min instead of ~9.
	$(BIN)/python -m pip install --quiet --upgrade pip uv || true
	$(BIN)/python -m uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[dev]' || \
		$(BIN)/python -m pip install --quiet --no-cache-dir -e '.[dev]'
	@# Festival (three voices) reads part of the built-in corpus, Flite its held-out sets (and tcmalloc, above).
	dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq $(APT_PACKAGES) >/dev/null 2>&1 || \
		  { apt-get update -qq && apt-get install -y -qq $(APT_PACKAGES); }; }; } \
		|| echo "note: the built-in corpus needs apt-get install $(APT_PACKAGES)"
	touch $(STAMP)

# The ASR demo: a hybrid TDT-CTC Conformer (asr_train_hybrid.yaml) on 2 cores, greedy WER first and beam + LM
# beside it. It keeps to a wall-clock budget of DEMO_WALL_S from the moment make starts: it builds what the recipe
# reads first (its corpora, tokenizer and LM: asr_train.py prepare_only=true), then trains for what the install
# and the build left of the budget, less DEMO_CLOSING_S for the start-up, the closing validation and the report
# (63-75 s measured on this project's 2-core machines; the fresh-clone demo then ends near 29 min 15 s, and the
# 30-minute limit leaves a slower machine 35-45 s more). On a fresh clone that is 16-22 minutes of training (a slow
# machine trains less rather than run over); with warm caches, more. The learning-rate schedule decays over
# whatever budget the run gets. At least DEMO_MIN_TRAIN_S, even if the budget is then missed.
# The closing validation (every set, greedy and beam + LM) is the demo's only one: Lightning's in-fit validations,
# at the end of the blended 28.8-h first epoch and again when the time limit stops the training, would each cost
# ~10 s of training for figures the closing gives anyway (every step counts here: ~0.1 WER point per 1% of steps
# at this budget); so the demo writes its model archive and last.ckpt, not checkpoints ranked by a validation
# metric (check_val_every_n_epoch=1000: no validation epoch within the demo's ~1.6 epochs).
# demo-ctc: the same data and encoder with CTC alone (asr_train.yaml), 17 minutes.
DEMO_START := $(shell date +%s)
DEMO_WALL_S ?= 1765
DEMO_CLOSING_S ?= 85
DEMO_MIN_TRAIN_S ?= 600
demo: install
	$(CPU_RUN) $(BIN)/python examples/asr_train.py --config-name asr_train_hybrid prepare_only=true
	@left=$$(( $(DEMO_START) + $(DEMO_WALL_S) - $(DEMO_CLOSING_S) - $$(date +%s) )); \
	if [ $$left -lt $(DEMO_MIN_TRAIN_S) ]; then \
		echo "make demo: $$left s left of its $(DEMO_WALL_S) s budget; training $(DEMO_MIN_TRAIN_S) s anyway"; \
		left=$(DEMO_MIN_TRAIN_S); fi; \
	echo "make demo: $$(( $$(date +%s) - $(DEMO_START) )) s since make started; training for $$left s"; \
	set -x; $(CPU_RUN) $(BIN)/python examples/asr_train.py --config-name asr_train_hybrid name=asr_demo \
		trainer.devices=2 model.train_ds.batch_duration=30 "trainer.max_time={seconds: $$left}" \
		trainer.check_val_every_n_epoch=1000

demo-ctc: install
	$(CPU_RUN) $(BIN)/python examples/asr_train.py trainer.devices=2 model.train_ds.batch_duration=30

# The TDT transducer demo: the CTC demo's data, tokenizer, encoder and 17-minute budget, with a TDT decoder.
demo-tdt: install
	$(CPU_RUN) $(BIN)/python examples/asr_train.py --config-name asr_train_tdt trainer.devices=2 \
		model.train_ds.batch_duration=30

# The TTS demo (60 min of training on 2 cores); judged by the newest ASR demo archive when there is one.
tts-demo: install
	ASR=$$(ls -t speechtrain_experiments/asr_demo/*/asr_demo.stm 2>/dev/null | head -1); \
	$(CPU_RUN) $(BIN)/python examples/tts_train.py trainer.devices=2 model.train_ds.batch_duration=30 \
		asr_model=$${ASR:-null}

# The SALM demo (under 60 min on 2 cores): an ASR encoder (16 min; skipped with ASR=<archive>), a tiny GPT
# pretrained on corpus text (6 min), then SALM (28 min) and its evaluation on the test split.
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

# The default suite (CI): everything but the tests marked slow (minutes each: real fine-tunes of imported NeMo
# checkpoints, the batch-size search). `make test-all` runs those too.
test: install lint
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not slow"

test-all: install lint
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

# Every example script at TP=1 and TP=2 (2 gloo processes), tiny sizes: losses, metrics, archives, exports and
# generated outputs equal (about 5 minutes on 2 cores; the default suite runs gpt_pretrain's).
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

clean:
	rm -rf $(VENV) speechtrain_experiments .pytest_cache .ruff_cache
