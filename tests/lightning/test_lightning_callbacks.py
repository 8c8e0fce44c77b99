import logging
import subprocess
import sys

import lightning.pytorch as pl
import pytest

from speechtrain.lightning import LIFECYCLE_EVENTS, BaseCallback, CallbackGroup, hook_class_init_with_callbacks


@pytest.fixture(autouse=True)
def _no_default_callbacks(monkeypatch):
    """These tests count and order the group's callbacks: leave the default telemetry callback out."""
    monkeypatch.setenv("SPEECHTRAIN_TELEMETRY", "0")
    CallbackGroup.reset()


class Recorder(BaseCallback):
    """Appends ``(name, event, args, kwargs)`` to a shared log for every lifecycle event and two custom ones."""

    def __init__(self, name: str, log: list):
        self.name = name
        self.log = log
        self.configs = []

    def update_config(self, trainer=None, **kwargs):
        self.configs.append((trainer, kwargs))

    def on_custom_event(self, *args, **kwargs):
        self.log.append((self.name, "on_custom_event", args, kwargs))

    def on_thing_start(self):
        self.log.append("start")

    def on_thing_end(self):
        self.log.append("end")


for _event in LIFECYCLE_EVENTS:

    def _record(self, *args, _event=_event, **kwargs):
        self.log.append((self.name, _event, args, kwargs))

    setattr(Recorder, _event, _record)


class Exploding(BaseCallback):
    def on_model_init_start(self):
        raise RuntimeError("observer bug")

    def update_config(self, trainer=None, **kwargs):
        raise RuntimeError("config bug")


class PlainLightningCallback(pl.Callback):
    """Not a BaseCallback: has no lifecycle hooks; its update_config must never be called by the group."""

    def __init__(self):
        self.update_config_calls = 0

    def update_config(self, trainer=None, **kwargs):
        self.update_config_calls += 1


# ----------------------------------------------------------------------------------------------- group basics
def test_group_is_a_process_wide_singleton_until_reset():
    group = CallbackGroup.get_instance()
    assert CallbackGroup.get_instance() is group
    group.register(Recorder("a", []))
    CallbackGroup.reset()
    fresh = CallbackGroup.get_instance()
    assert fresh is not group
    assert fresh.callbacks == []


def test_register_ignores_the_same_object_twice_and_unregister_removes_it():
    group = CallbackGroup.get_instance()
    log = []
    a, b = Recorder("a", log), Recorder("a", log)
    group.register(a)
    group.register(a)
    group.register(b)
    assert [id(cb) for cb in group.callbacks] == [id(a), id(b)]
    group.callbacks.clear()  # a copy: the group keeps its list
    assert len(group.callbacks) == 2
    group.unregister(a)
    group.unregister(a)
    assert [id(cb) for cb in group.callbacks] == [id(b)]


def test_lifecycle_event_reaches_every_callback_in_registration_order():
    group = CallbackGroup.get_instance()
    log = []
    for callback in (Recorder("first", log), PlainLightningCallback(), BaseCallback(), Recorder("second", log)):
        group.register(callback)
    group.on_model_init_start()
    group.on_save_checkpoint_start(global_step=7)
    assert log == [
        ("first", "on_model_init_start", (), {}),
        ("second", "on_model_init_start", (), {}),
        ("first", "on_save_checkpoint_start", (), {"global_step": 7}),
        ("second", "on_save_checkpoint_start", (), {"global_step": 7}),
    ]


def test_arbitrary_event_reaches_only_callbacks_that_implement_it():
    group = CallbackGroup.get_instance()
    log = []
    plain = PlainLightningCallback()
    for callback in (BaseCallback(), Recorder("x", log), plain, Recorder("y", log)):
        group.register(callback)
    group.on_custom_event(3, unit="s")
    group.on_event_nobody_implements(1)
    assert log == [("x", "on_custom_event", (3,), {"unit": "s"}), ("y", "on_custom_event", (3,), {"unit": "s"})]
    with pytest.raises(AttributeError, match="no attribute 'custom_event'"):
        group.custom_event  # noqa: B018  (only ``on_*`` names are events)


def test_every_lifecycle_event_matches_base_callback_signatures():
    group = CallbackGroup.get_instance()
    log = []
    group.register(BaseCallback())  # the no-op defaults accept what the framework passes
    group.register(Recorder("r", log))
    for event in LIFECYCLE_EVENTS:
        if event.startswith("on_save_checkpoint"):
            getattr(group, event)(global_step=5)
        else:
            getattr(group, event)()
    assert [entry[1] for entry in log] == list(LIFECYCLE_EVENTS)


def test_failing_callback_is_logged_and_the_others_still_receive_the_event(caplog):
    group = CallbackGroup.get_instance()
    log = []
    group.register(Recorder("before", log))
    group.register(Exploding())
    group.register(Recorder("after", log))
    with caplog.at_level(logging.ERROR, logger="speechtrain.lightning.callbacks"):
        group.on_model_init_start()
    assert [entry[0] for entry in log] == ["before", "after"]
    (record,) = [r for r in caplog.records if r.name == "speechtrain.lightning.callbacks"]
    assert record.getMessage() == "Callback Exploding failed in on_model_init_start; the run continues."
    assert record.exc_info is not None and str(record.exc_info[1]) == "observer bug"


def test_app_start_and_app_end_are_delivered_once():
    group = CallbackGroup.get_instance()
    log = []
    group.register(Recorder("r", log))
    for _ in range(3):
        group.on_app_start()
    group.on_app_end()
    group.on_app_end()
    assert [entry[1] for entry in log] == ["on_app_start", "on_app_end"]
    # Other events are not limited.
    group.on_model_init_start()
    group.on_model_init_start()
    assert [entry[1] for entry in log][2:] == ["on_model_init_start", "on_model_init_start"]


_AT_EXIT_SCRIPT = """
import sys
from speechtrain.lightning import BaseCallback, CallbackGroup

class Goodbye(BaseCallback):
    def __init__(self, word):
        self.word = word

    def on_app_end(self):
        print(self.word, flush=True)

if sys.argv[1] == "explicit":
    CallbackGroup.get_instance().register(Goodbye("forgotten"))
    CallbackGroup.reset()  # the forgotten group must not fire at exit either
    group = CallbackGroup.get_instance()
    group.register(Goodbye("app end"))
    group.on_app_end()
    group.on_app_end()
else:
    CallbackGroup.get_instance().register(Goodbye("app end"))
print("script done", flush=True)
"""


@pytest.mark.parametrize(
    "mode, expected",
    [("explicit", ["app end", "script done"]), ("implicit", ["script done", "app end"])],
)
def test_app_end_fires_exactly_once_per_process_at_exit(mode, expected):
    result = subprocess.run([sys.executable, "-c", _AT_EXIT_SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == expected


# --------------------------------------------------------------------------------------------- update_config
def _bare_trainer(tmp_path):
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def test_update_config_asks_only_base_callbacks_and_attaches_everything_once(tmp_path):
    group = CallbackGroup.get_instance()
    log = []
    first, second, plain = Recorder("first", log), Recorder("second", log), PlainLightningCallback()
    for callback in (first, plain, second):
        group.register(callback)
    trainer = _bare_trainer(tmp_path)
    before = list(trainer.callbacks)

    group.update_config(trainer=trainer, model="the model")
    group.update_config(trainer=trainer, model="the model")

    assert first.configs == [(trainer, {"model": "the model"})] * 2
    assert second.configs == [(trainer, {"model": "the model"})] * 2
    assert plain.update_config_calls == 0
    added = trainer.callbacks[len(before) :]
    assert [id(cb) for cb in added] == [id(first), id(plain), id(second)]
    assert trainer.callbacks[: len(before)] == before


def test_update_config_gives_instances_of_one_class_distinct_state_keys():
    group = CallbackGroup.get_instance()
    callbacks = [Recorder("a", []), Recorder("b", []), BaseCallback()]
    for callback in callbacks:
        group.register(callback)
    group.update_config(trainer=None)
    keys = [cb.state_key for cb in callbacks]
    assert keys == ["Recorder", "Recorder#1", "BaseCallback"]
    assert all(isinstance(k, str) for k in keys)
    group.update_config(trainer=None)
    assert [cb.state_key for cb in callbacks] == keys


def test_update_config_survives_a_failing_callback(tmp_path, caplog):
    group = CallbackGroup.get_instance()
    recorder = Recorder("r", [])
    exploding = Exploding()
    group.register(exploding)
    group.register(recorder)
    trainer = _bare_trainer(tmp_path)
    with caplog.at_level(logging.ERROR, logger="speechtrain.lightning.callbacks"):
        group.update_config(trainer=trainer)
    assert recorder.configs == [(trainer, {})]
    assert any(cb is exploding for cb in trainer.callbacks) and any(cb is recorder for cb in trainer.callbacks)
    assert "Callback Exploding failed in update_config; the run continues." in caplog.text


# --------------------------------------------------------------------------------------------- init hooks
def _hierarchy(log):
    class A:
        def __init__(self, value=0):
            log.append("A body")
            self.value = value

    class B(A):
        def __init__(self, value=0):
            log.append("B body")
            super().__init__(value)

    class C(B):
        def __init__(self, value=0):
            log.append("C body")
            super().__init__(value=value)

    for cls in (A, B, C):
        hook_class_init_with_callbacks(cls, "on_thing_start", "on_thing_end")
    return A, B, C


@pytest.fixture
def init_log():
    log = []
    CallbackGroup.get_instance().register(Recorder("r", log))
    return log


def test_hooked_hierarchy_emits_one_pair_around_all_init_bodies(init_log):
    A, B, C = _hierarchy(init_log)
    obj = C(5)
    assert obj.value == 5
    assert init_log == ["start", "C body", "B body", "A body", "end"]
    init_log.clear()
    B()
    A()
    assert init_log == ["start", "B body", "A body", "end", "start", "A body", "end"]


def test_hooking_twice_still_emits_once_and_keeps_the_wrapper(init_log):
    A, B, C = _hierarchy(init_log)
    wrappers = [cls.__init__ for cls in (A, B, C)]
    for cls in (C, B, A, C):
        hook_class_init_with_callbacks(cls, "on_thing_start", "on_thing_end")
    assert [cls.__init__ for cls in (A, B, C)] == wrappers
    assert C.__init__.__name__ == "__init__" and C.__init__.__qualname__.endswith("C.__init__")
    C()
    assert init_log == ["start", "C body", "B body", "A body", "end"]


def test_subclass_without_its_own_init_emits_once(init_log):
    A, _, C = _hierarchy(init_log)

    class D(C):
        pass

    hook_class_init_with_callbacks(D, "on_thing_start", "on_thing_end")
    D(1)
    assert init_log == ["start", "C body", "B body", "A body", "end"]


def test_end_fires_even_if_init_raises_and_the_next_construction_emits_again(init_log):
    A, B, _ = _hierarchy(init_log)

    class Broken(B):
        def __init__(self, fail):
            super().__init__()
            log_and_maybe_fail(fail)

    def log_and_maybe_fail(fail):
        init_log.append("Broken body")
        if fail:
            raise ValueError("bad config")

    hook_class_init_with_callbacks(Broken, "on_thing_start", "on_thing_end")
    with pytest.raises(ValueError, match="bad config"):
        Broken(fail=True)
    assert init_log == ["start", "B body", "A body", "Broken body", "end"]
    init_log.clear()
    Broken(fail=False)
    assert init_log == ["start", "B body", "A body", "Broken body", "end"]


def test_nested_construction_of_another_object_emits_its_own_pair(init_log):
    A, B, _ = _hierarchy(init_log)

    class Owner(B):
        def __init__(self):
            init_log.append("Owner body")
            self.part = A(2)
            super().__init__()

    hook_class_init_with_callbacks(Owner, "on_thing_start", "on_thing_end")
    owner = Owner()
    assert owner.part.value == 2
    assert init_log == ["start", "Owner body", "start", "A body", "end", "B body", "A body", "end"]
