"""Every shipped YAML composes against its script's schema, and the ASR recipes build their models on the meta
device (shapes only, no memory, no weights): a broken recipe fails CI, not a GPU job."""

import importlib.util
from pathlib import Path

import pytest
import torch

from speechtrain.core.hydra_runner import compose_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# A YAML is composed by the script of the same name, or by the one named here (``--config-name``).
SCRIPT_OF = {name: "asr_train" for name in ("fastconformer_ctc_large", "asr_train_tdt", "asr_train_rnnt",
                                            "asr_train_augmented", "asr_train_hybrid", "asr_train_streaming",
                                            "librispeech_fastconformer_ctc")}  # fmt: skip
# What a recipe leaves to the command line (data, archives), filled with stand-ins that need no file.
REQUIRED = {
    "asr_finetune": ["init_from.path=base.stm"],
    "tts_cfg_distill": ["model.distillation.teacher_path=teacher.stm"],
}
YAMLS = sorted(p.stem for p in (EXAMPLES / "conf").glob("*.yaml"))


def _main(script):
    spec = importlib.util.spec_from_file_location(f"recipe_{script}", EXAMPLES / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("name", YAMLS)
def test_every_shipped_yaml_composes_against_its_schema(name):
    main = _main(SCRIPT_OF.get(name, name))
    assert main.schema is not None and (main.config_dir / f"{name}.yaml").is_file()
    cfg = compose_config(main.config_dir, name, REQUIRED.get(name, []), main.schema, main.translate)
    assert cfg.name  # composed and validated: every key known, every value of its type


def _meta_model(name, *overrides):
    """The recipe's config and its model: front-end on the CPU (small), encoder and CTC head on the meta device."""
    from omegaconf import OmegaConf

    from speechtrain.asr.features import LogMelFeatures
    from speechtrain.asr.jobs import asr_model_class
    from speechtrain.asr.spec_augment import SpecAugment

    main = _main(SCRIPT_OF.get(name, name))
    cfg = compose_config(main.config_dir, name, list(overrides), main.schema, main.translate)
    cfg.model.tokenizer.vocab = [chr(0x4E00 + i) for i in range(cfg.model.tokenizer.vocab_size)]  # stand-in
    model = asr_model_class(cfg.model)(cfg.model)  # config checks and tokenizer; the layers come in configure_model
    LogMelFeatures(OmegaConf.to_object(cfg.model.preprocessor), cfg.model.sample_rate)
    if cfg.model.spec_augment:
        SpecAugment(OmegaConf.to_object(cfg.model.spec_augment))
    with torch.device("meta"):
        encoder, width = model.build_encoder()
        head = torch.nn.Linear(width, model.tokenizer.vocab_size + 1)
    return cfg, torch.nn.ModuleList([encoder, head])


@pytest.mark.parametrize("name", ["asr_train", "fastconformer_ctc_large"])
def test_asr_recipes_build_their_models_on_the_meta_device(name):
    cfg, model = _meta_model(name)
    params = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    if name == "fastconformer_ctc_large":
        # NeMo's recipe: 18 layers of d_model 512, 8x dw_striding, SpecAugment on, cosine over max_steps.
        enc = cfg.model.encoder
        assert (enc.d_model, enc.num_layers, enc.num_heads, enc.conv_kernel_size) == (512, 18, 8, 9)
        assert (enc.subsampling, enc.subsampling_factor, enc.xscaling) == ("dw_striding", 8, True)
        assert cfg.model.spec_augment.freq_masks == 2 and cfg.model.spec_augment.time_masks == 10
        assert cfg.trainer.max_time is None and cfg.trainer.max_steps > 0 and cfg.model.optim.sched.name == "cosine"
        assert cfg.trainer.strategy.tensor_model_parallel_size == 1 and cfg.model.train_ds.pin_memory
        assert 100e6 < params < 140e6, params
    else:
        assert 3e6 < params < 6e6, params  # the 4.3M CPU demo


ASR_RECIPES = ["asr_train", *sorted(n for n, script in SCRIPT_OF.items() if script == "asr_train")]


def _sizes():
    from speechtrain.asr.ctc import MODEL_SIZES

    return sorted(MODEL_SIZES)


@pytest.mark.parametrize("name", ASR_RECIPES)
def test_every_size_builds_on_every_asr_recipe_with_no_other_override(name):
    """``model.size=NAME`` alone gives a working model: what depends on the depth (intermediate-CTC taps, the
    temporal U-Net's span) comes with the size, so no recipe refuses a size."""
    for size in _sizes():
        cfg, model = _meta_model(name, f"model.size={size}")
        assert cfg.model.size == size and all(p.is_meta for p in model.parameters()), size


@pytest.mark.parametrize("name", YAMLS)
def test_every_lightning_trainer_argument_is_accepted_without_plus_in_every_recipe(name):
    import inspect

    import lightning.pytorch as pl

    main = _main(SCRIPT_OF.get(name, name))
    arguments = [a for a in inspect.signature(pl.Trainer.__init__).parameters if a not in ("self", "strategy")]
    base = compose_config(main.config_dir, name, REQUIRED.get(name, []), main.schema, main.translate)
    if "trainer" not in base:
        pytest.skip(f"{name} trains without a Lightning Trainer")
    overrides = [f"trainer.{a}=null" for a in arguments if a not in base.trainer]
    cfg = compose_config(main.config_dir, name, [*REQUIRED.get(name, []), *overrides], main.schema, main.translate)
    assert all(a in cfg.trainer for a in arguments), name
