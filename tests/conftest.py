"""Shared fixtures: tiny model configs and a small generated corpus."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from speechtrain.asr.ctc import INTERCTC_OFF, UNET_OFF
from speechtrain.corpora.dtmf import make_dtmf_corpus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True)
def _fresh_callback_group():
    """Lifecycle callbacks registered by one test must not reach the next."""
    from speechtrain.lightning import CallbackGroup

    CallbackGroup.reset()
    yield
    CallbackGroup.reset()


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("speechtrain-cache")


@pytest.fixture(autouse=True)
def _private_datasets_cache(_session_cache, monkeypatch):
    """Tokenizers and LMs that tests fit go to a folder of the test session, never to the user's cache."""
    from speechtrain.lightning import settings

    monkeypatch.setattr(settings, "SPEECHTRAIN_DATASETS_CACHE", _session_cache)


@pytest.fixture(scope="session")
def dtmf_manifest(tmp_path_factory):
    """A 48-utterance DTMF corpus (NeMo manifest path)."""
    return make_dtmf_corpus(tmp_path_factory.mktemp("dtmf"), 48, seed=7)


def tiny_ctc_config(manifest=None, **encoder):
    """A ConvCTCModel config small enough for a unit test."""
    return {
        "tokenizer": {"vocab": [" ", *"0123456789"]},
        "preprocessor": {"n_mels": 16, "dither": 0.0},
        "encoder": {"d_model": 16, "num_layers": 1, "kernel_size": 3, "dropout": 0.0, **encoder},
        "train_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 8, "shuffle": True},
        "validation_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 16},
        "optim": {"lr": 3e-3, "sched": {"name": "constant", "warmup_steps": 2}},
    }


# ------------------------------------------------- the ASR example script, shrunk to a tiny model and DTMF
def spread_weights(model):
    """``model`` with every weight moved by 0.1 * N(0, 1), in eval mode: an untrained model says (almost) only
    blank, and this makes it say something (the streaming and ONNX streaming tests compare transcripts)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def chirp(seconds=2.3, seed=1):
    """A rising tone with a little noise at 16 kHz (float32), the streaming tests' audio."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 16000)) / 16000
    return (0.3 * torch.sin(2 * torch.pi * 440 * t * (1 + t)) + 0.05 * torch.randn(t.shape, generator=g)).float()


def example_main():
    """``main`` of examples/asr_train.py, loaded fresh."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("asr_train_example", EXAMPLES / "asr_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def example_overrides(tmp_path, manifest):
    """Command-line overrides that shrink the example to a tiny Conformer on the DTMF corpus, run in ``tmp_path``."""
    from speechtrain.common.tokenizers import CharTokenizer

    tmp_path.mkdir(parents=True, exist_ok=True)
    tokenizer = tmp_path / "digits.json"
    CharTokenizer([" ", *"0123456789"]).save(tokenizer)
    return [
        f"exp_manager.exp_dir={tmp_path / 'exp'}",
        "trainer.precision=32",
        "trainer.max_time=null",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "trainer.num_sanity_val_steps=0",
        f"model.tokenizer.path={tokenizer}",
        f"model.train_ds.manifest_filepath={manifest}",
        f"model.validation_ds.manifest_filepath={manifest}",
        "model.encoder.d_model=16",
        "model.encoder.num_layers=1",
        *INTERCTC_OFF,  # the demo's intermediate CTC taps (layers 2 and 5) need a deeper encoder
        *UNET_OFF,  # and so do its half-rate layers (2 to 6)
        "model.encoder.num_heads=2",
        "model.encoder.conv_kernel_size=3",
        "model.encoder.subsampling_conv_channels=8",
        "model.encoder.subsampling_factor=2",
        "model.encoder.dropout=0.1",
        "model.preprocessor.n_mels=16",
        "model.train_ds.batch_size=8",
        "model.train_ds.batch_duration=null",
        "model.train_ds.num_workers=0",
        "model.optim.sched.warmup_steps=2",
        "exp_manager.checkpoint_callback_params.save_top_k=1",
    ]


def example_job(tmp_path, manifest, *overrides):
    """The example's real config, shrunk to a tiny Conformer and the DTMF corpus, plus CLI-style overrides."""
    from speechtrain.asr.ctc import ConformerCTCConfig
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.core.job import train_job_schema

    base = example_overrides(tmp_path, manifest)
    return compose_config(EXAMPLES / "conf", "asr_train", [*base, *overrides], train_job_schema(ConformerCTCConfig))


def run_folder(tmp_path, name="asr_demo"):
    (folder,) = (tmp_path / "exp" / name).iterdir()
    return folder


def final_weights(tmp_path):
    """The weights in the run's final archive."""
    from speechtrain.core.archive import read_archive

    return read_archive(run_folder(tmp_path) / "asr_demo.stm").state_dict


# --------------------------------------------- the fault-injection suite's report (tests/reliability/test_faults.py)
# Each test records the faults it injected and whether the run survived; the terminal summary prints the table
# (faults injected / survived / training steps lost).
@dataclass
class Fault:
    name: str
    injected: int = 1
    survived: int = 0
    steps_lost: int | None = None

    def survive(self, steps_lost: int = 0) -> None:
        """Call at the end of the test, after its assertions: the run came through."""
        self.survived, self.steps_lost = self.injected, steps_lost


FAULTS: list[Fault] = []


@pytest.fixture
def fault():
    """``fault(name, injected=1)`` registers a fault; ``.survive(steps_lost)`` marks it survived."""

    def register(name: str, injected: int = 1) -> Fault:
        FAULTS.append(Fault(name, injected))
        return FAULTS[-1]

    return register


def pytest_terminal_summary(terminalreporter):
    if not FAULTS:
        return
    width = max(len(f.name) for f in FAULTS)
    terminalreporter.section("fault injection")
    terminalreporter.write_line(f"{'fault':<{width}}  injected  survived  steps lost")
    for f in FAULTS:
        lost = "-" if f.steps_lost is None else str(f.steps_lost)
        terminalreporter.write_line(f"{f.name:<{width}}  {f.injected:>8}  {f.survived:>8}  {lost:>10}")
    injected, survived = sum(f.injected for f in FAULTS), sum(f.survived for f in FAULTS)
    lost = sum(f.steps_lost or 0 for f in FAULTS)
    terminalreporter.write_line(f"{'total':<{width}}  {injected:>8}  {survived:>8}  {lost:>10}")
