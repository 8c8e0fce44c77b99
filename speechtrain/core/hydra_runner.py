"""``@hydra_runner``: the entry point of every ``examples/`` script.

Hydra composes the YAML config and the command-line overrides (``a.b=v``, ``+new=v``, ``++upsert=v``, ``~del``,
``--config-path``, ``--config-name``); the result is checked against the script's typed schema, so a misspelt key
stops the job at once with a message that names it and suggests the right one. Hydra's own run folders, logging
takeover and working-directory change are not used: the run manager owns the run folder.

Extra flags: ``--cfg`` prints the composed, validated config and exits; ``-h``/``--help`` prints usage.
"""

import dataclasses
import functools
import inspect
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from speechtrain.common.config import (
    ConfigError,
    accepted_keywords,
    nested_schema,
    schema_field,
    unknown_key_message,
    validate_config,
)
from speechtrain.core.exp_manager import discard_new_run_folder, forget_new_run_folder, log_to_run_file
from speechtrain.lightning import CallbackGroup
from speechtrain.lightning.noise import rank_zero_info_only

_OVERRIDE_KEY = re.compile(r"^(?P<prefix>~|\+\+|\+)?(?P<key>[\w.\-/@]+)")
USAGE = """usage: {prog} [--config-path DIR] [--config-name NAME] [--cfg] [key=value | +key=value | ~key ...]

Overrides use Hydra's grammar: model.optim.lr=1e-4 sets a key, +key=v adds a new one, ++key=v sets or adds,
~key deletes. --cfg prints the composed config (every key with its value or default) and exits.
A mistake in a key or value stops the job with one line and exit status 2. Config: {config}"""


def _parse_argv(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    options: dict[str, Any] = {"print_cfg": False, "help": False}
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        flag, has_value, value = item.partition("=")
        if item in ("-h", "--help"):
            options["help"] = True
        elif item in ("--cfg", "-c"):
            options["print_cfg"] = True
            if i + 1 < len(argv) and argv[i + 1] in ("job", "all"):  # Hydra's `--cfg job` spelling
                i += 1
        elif flag in ("--config-path", "-cp", "--config-name", "-cn"):
            if not has_value:
                i += 1
                if i == len(argv):
                    raise ConfigError(f"{flag} needs a value.")
                value = argv[i]
            options["config_path" if flag in ("--config-path", "-cp") else "config_name"] = value
        else:
            overrides.append(item)
        i += 1
    return options, overrides


def _explain_override_failure(config_name: str, overrides: list[str], error: Exception, schema: type | None) -> str:
    """Hydra's message, plus a suggestion for each override that names a key the config does not have."""
    try:
        base = compose(config_name=config_name, overrides=[])
    except (HydraException, OmegaConfBaseException):
        return str(error)
    hints = []
    for override in overrides:
        match = _OVERRIDE_KEY.match(override)
        if match is None or match.group("prefix") in ("+", "++"):
            continue
        parent, _, leaf = match.group("key").rpartition(".")
        node = OmegaConf.select(base, parent) if parent else base
        if isinstance(node, DictConfig) and leaf not in node:
            typed = _schema_keys(schema, parent)
            allowed = {str(k) for k in node.keys()} | (_signature_keys(schema, parent) or set()) | (typed or set())
            hint = unknown_key_message(parent, leaf, allowed)
            if "Did you mean" not in hint and typed is None:
                hint += f" To add a new key, write +{match.group('key')}=..."
            hints.append(hint)
    return "\n".join(hints) if hints else str(error)


def _schema_keys(schema: type | None, dotted_key: str) -> set[str] | None:
    """The field names of the dataclass that ``dotted_key`` names in ``schema`` (the whole schema for ``""``), or
    None when that node is free-form (no typed schema: a new key may be added with ``+``)."""
    if schema is None:
        return None
    if not dotted_key:
        return {f.name for f in dataclasses.fields(schema)}
    node = schema_field(schema, dotted_key)
    nested = nested_schema(node) if node is not None else None
    return {f.name for f in dataclasses.fields(nested)} if nested is not None else None


def _signature_keys(schema: type | None, dotted_key: str) -> set[str] | None:
    """The keywords a free-form schema node accepts (``keys_from``), e.g. ``Trainer``'s arguments for ``trainer``."""
    node = schema_field(schema, dotted_key) if schema is not None and dotted_key else None
    keys_from = node.metadata.get("keys_from") if node is not None else None
    return accepted_keywords(keys_from) if keys_from is not None else None


def _upsert_known_arguments(overrides: list[str], schema: type | None) -> list[str]:
    """Let ``trainer.enable_progress_bar=false`` set any real ``Trainer`` argument, and ``model.encoder.d_model=16``
    any key of the schema, listed in the YAML or not.

    Free-form nodes checked against a signature (``keys_from``) accept every argument of that signature; Hydra
    would otherwise demand ``+`` for keys the YAML does not list.
    """
    if schema is None:
        return overrides
    result = []
    for override in overrides:
        match = _OVERRIDE_KEY.match(override)
        if match is not None and match.group("prefix") is None and "=" in override:
            key = match.group("key")
            parent, _, leaf = key.rpartition(".")
            if leaf in (_signature_keys(schema, parent) or ()) or schema_field(schema, key) is not None:
                override = f"++{override}"
        result.append(override)
    return result


Schema = type | Callable[[Any], type]
Translate = Callable[[DictConfig], Any]


def compose_config(
    config_dir: str | Path,
    config_name: str,
    overrides: list[str],
    schema: Schema | None = None,
    translate: Translate | None = None,
) -> DictConfig:
    """Compose ``config_name`` from ``config_dir`` with ``overrides`` and validate it against ``schema``.

    Args:
        schema: the dataclass the config must fit, or a function that picks it from the composed config (a script
            whose configs are of several kinds, e.g. CTC or transducer).
        translate: applied to the composed config before it is validated (e.g. a NeMo YAML's translation).

    Raises:
        ConfigError: a bad override, an unknown key (with a suggestion) or a wrong type.
    """
    config_dir = str(Path(config_dir).resolve())
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        if schema is not None and not isinstance(schema, type):
            schema = schema(_translated(_compose_as_given(config_name, overrides), translate))
        overrides = _upsert_known_arguments(overrides, schema)
        try:
            cfg = compose(config_name=config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            raise ConfigError(_explain_override_failure(config_name, overrides, error, schema)) from error
    if schema is not None:
        cfg = validate_config(_translated(cfg, translate), schema)
    return cfg


def _compose_as_given(config_name: str, overrides: list[str]) -> DictConfig:
    """The config with the overrides Hydra takes as written (without them where one needs the schema's help)."""
    try:
        return compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException):
        return compose(config_name=config_name, overrides=[])


def _translated(cfg: DictConfig, translate: Translate | None) -> Any:
    return cfg if translate is None else translate(cfg)


def hydra_runner(
    config_path: str | None = "conf",
    config_name: str | None = None,
    schema: Schema | None = None,
    translate: Translate | None = None,
) -> Callable[[Callable[[DictConfig], Any]], Callable[..., Any]]:
    """Decorate ``main(cfg)`` of an entry script.

    Args:
        config_path: config folder, relative to the decorated script's file (like Hydra).
        config_name: YAML file name without extension.
        schema: dataclass the composed config must fit (see :mod:`speechtrain.common.config`), or a function that
            picks it from the composed config.
        translate: applied to the composed config before validation (see :func:`compose_config`).

    The decorated function, called without arguments, reads ``sys.argv``; called with a config, it runs on that.
    Lifecycle events ``on_app_start`` / ``on_app_end`` bracket the job. From the command line, a mistake in what
    the user gave (:data:`USER_ERRORS`) ends the job with one line on stderr and exit status 2, and a run folder it
    created without writing a checkpoint is removed; any error that ends a run is written to its ``train.log``.
    """

    def decorator(task: Callable[[DictConfig], Any]) -> Callable[..., Any]:
        script_dir = Path(inspect.getfile(task)).resolve().parent
        script_doc = task.__globals__.get("__doc__")  # the script's docstring: its examples, shown by --help

        @functools.wraps(task)
        def wrapper(cfg: DictConfig | None = None) -> Any:
            if not logging.getLogger().handlers:  # before composing: a NeMo YAML's translation is logged
                logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(levelname)s %(name)s] %(message)s")
                for handler in logging.getLogger().handlers:  # the other ranks' INFO lines repeat rank 0's
                    handler.addFilter(rank_zero_info_only)
            command_line = cfg is None
            if command_line:
                cfg = _config_from_argv(
                    sys.argv[1:], script_dir, config_path, config_name, schema, script_doc, translate
                )
                if cfg is None:
                    return None
            group = CallbackGroup.get_instance()
            group.on_app_start()
            forget_new_run_folder()
            try:
                return task(cfg)
            except USER_ERRORS as error:
                if not command_line:  # a caller with a config of its own handles the exception
                    raise
                _stop_on_user_error(error)
            except Exception:
                log_to_run_file(logging.ERROR, f"The run ended with an error:\n{traceback.format_exc()}")
                raise
            finally:
                group.on_app_end()

        # What the script composes, for tools and tests that check every shipped config against its schema.
        wrapper.schema = schema
        wrapper.translate = translate
        wrapper.config_name = config_name
        wrapper.config_dir = script_dir / config_path if config_path else script_dir
        return wrapper

    return decorator


# Mistakes in what the user gave (a config value, a path, a file): one line naming the culprit, exit status 2. The
# traceback is kept out of the way (SPEECHTRAIN_TRACEBACK=1 shows it) since the message names the key and the fix.
USER_ERRORS = (ConfigError, FileNotFoundError, ValueError, MisconfigurationException)


def _stop_on_user_error(error: Exception) -> NoReturn:
    """Print ``<script>: error: <message>`` (one line), drop a run folder that this job created and that holds no
    checkpoint, else record the error in its ``train.log``; exit with status 2."""
    if os.environ.get("SPEECHTRAIN_TRACEBACK", "0") not in ("", "0"):
        raise error
    message = " ".join(str(error).split())
    if isinstance(error, MisconfigurationException):
        message = f"Lightning refused the trainer settings (trainer.*): {message}"
    removed = discard_new_run_folder()
    if removed is None:
        log_to_run_file(logging.ERROR, f"The run ended with an error: {message}\n{traceback.format_exc()}")
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _config_from_argv(
    argv: list[str],
    script_dir: Path,
    config_path: str | None,
    config_name: str | None,
    schema: Schema | None,
    doc: str | None = None,
    translate: Translate | None = None,
) -> DictConfig | None:
    prog = Path(sys.argv[0]).name
    try:
        options, overrides = _parse_argv(argv)
        if options["help"]:
            print(USAGE.format(prog=prog, config=script_dir / (config_path or ".") / f"{config_name}.yaml"))
            if doc:
                print(f"\n{doc.strip()}")
            return None
        config_dir = Path(options.get("config_path") or config_path or ".")
        if not config_dir.is_absolute():
            # --config-path is relative to the working directory, the decorator's to the script (Hydra's rule).
            config_dir = (Path.cwd() if "config_path" in options else script_dir) / config_dir
        name = options.get("config_name") or config_name
        if not name:
            raise ConfigError("No config name: pass --config-name NAME.")
        if not (config_dir / f"{name}.yaml").is_file():
            raise ConfigError(f"No config file {config_dir / (name + '.yaml')}.")
        cfg = compose_config(config_dir, name, overrides, schema, translate)
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if options["print_cfg"]:
        print(OmegaConf.to_yaml(cfg))
        return None
    return cfg
