"""Every command answers ``--help`` (options, defaults, an example; exit 0), and the key=value tools share one
parser: a bad argument is one line on stderr and exit status 2."""

import importlib
import importlib.util

import pytest

KEY_VALUE_TOOLS = {
    "speechtrain.asr.transcribe": ["model_path=null", "audio=null", "batch_duration=300.0", "decoding=null"],
    "speechtrain.tts.synthesize": ["model_path=null", "text=null", "out_dir=tts_out", "guidance_scale=null"],
    "speechtrain.speechlm.generate": ["model_path=null", "prompt=null", "max_new_tokens=64", "greedy=True"],
    "speechtrain.asr.ngram": ["manifest=null", "output=null", "order=3"],
}
ARGPARSE_TOOLS = [
    "speechtrain.asr.tokenizer",
    "speechtrain.datatools.estimate_duration_bins",
    "speechtrain.datatools.oomptimizer",
    "speechtrain.datatools.to_shar",
    "speechtrain.datatools.blend_weights",
]


@pytest.mark.parametrize("module", sorted(KEY_VALUE_TOOLS))
def test_key_value_tools_answer_help_with_options_defaults_and_an_example(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and f"python -m {module} " in out  # the docstring's example command
    for option in KEY_VALUE_TOOLS[module]:
        assert f"  {option} " in out or out.rstrip().endswith(f"  {option}"), option
    assert "options (key=default):" in out


@pytest.mark.parametrize("module", sorted(KEY_VALUE_TOOLS))
@pytest.mark.parametrize("argv, message", [(["--verbose"], "Arguments must be key=value"),
                                           (["modle_path=x"], "Unknown config key 'modle_path'")])  # fmt: skip
def test_key_value_tools_share_one_parser_one_line_exit_2(module, argv, message, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in line and message in line


@pytest.mark.parametrize("module", ARGPARSE_TOOLS)
def test_argparse_tools_answer_help(module, capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(["--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage: ")


@pytest.mark.parametrize("script", ["asr_train", "asr_finetune", "tts_train", "salm_train"])
def test_example_scripts_answer_help_with_their_examples(script, capsys, monkeypatch):
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location(f"help_{script}", examples / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--help"])
    assert module.main() is None
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {script}.py ") and f"python examples/{script}.py" in out
    assert str(examples / "conf" / f"{script}.yaml") in out
