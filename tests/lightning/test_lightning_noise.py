import logging
import warnings

import lightning.pytorch as pl

import speechtrain.lightning  # noqa: F401  (installs the filters)


def test_lightning_cloud_tips_are_dropped_but_other_info_is_kept(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        pl.Trainer(accelerator="cpu", logger=True, enable_progress_bar=False)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("Tip" in m for m in messages)
    assert any("GPU available" in m for m in messages)


def test_only_the_leafspec_deprecation_is_ignored():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        speechtrain.lightning.silence_upstream_noise()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]


def test_the_start_of_a_multi_process_run_is_one_line():
    from speechtrain.lightning.noise import _short_launch_lines

    text = f"{'-' * 100}\ndistributed_backend=gloo\nAll distributed processes registered. Starting with 2 processes\n"
    banner = logging.LogRecord("x", logging.INFO, "f", 1, text + f"{'-' * 100}\n", (), None)
    assert _short_launch_lines(banner) and banner.getMessage() == "distributed: gloo, 2 processes registered"
    rank = "Initializing distributed: GLOBAL_RANK: {}, MEMBER: {}/2"
    lines = [logging.LogRecord("x", logging.INFO, "f", 1, rank.format(r, r + 1), (), None) for r in (0, 1)]
    assert [_short_launch_lines(r) for r in lines] == [True, False]
    tpu = logging.LogRecord("x", logging.INFO, "f", 1, "TPU available: False, using: 0 TPU cores", (), None)
    assert not _short_launch_lines(tpu)
