"""The engine runs in an explicit session; ckpt.save/ckpt.load are thin wrappers over the default one.

A manager used to reach the engine through private keyword arguments of the public
functions (``_saver=``, ``_partial_template=``); now it hands the engine its own
:class:`~ckpt.saving.session.Session` (saver, checkpoint group, storage options, events,
partial templates), and the public functions take only what a user passes.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import ckpt
from ckpt.saving import async_save, saves
from ckpt.saving.session import Session, default_session
from ckpt.tiers import durable

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("fn", [ckpt.save, ckpt.load])
def test_the_public_functions_take_only_public_arguments(fn):
    private = [name for name in inspect.signature(fn).parameters if name.startswith("_")]
    assert private == []


def test_a_manager_runs_every_save_and_load_in_its_own_session(tmp_root, monkeypatch):
    seen: list[tuple[str, Session]] = []
    real_save, real_load = saves.save_in, durable.load_in

    def spy_save(session, *args, **kwargs):
        seen.append(("save", session))
        return real_save(session, *args, **kwargs)

    def spy_load(session, *args, **kwargs):
        seen.append(("load", session))
        return real_load(session, *args, **kwargs)

    monkeypatch.setattr(saves, "save_in", spy_save)
    monkeypatch.setattr(durable, "load_in", spy_load)
    events: list[str] = []
    model = torch.nn.Linear(3, 2)
    one_off = async_save.default_saver().pending  # what earlier one-off saves left
    with ckpt.CheckpointManager(
        tmp_root, {"model": model}, every=1, async_save=True,
        on_event=lambda name, step, **fields: events.append(name),
    ) as manager:  # fmt: skip
        manager.resume()
        manager.maybe_save(1)
        manager.maybe_save(2)
        assert async_save.default_saver().pending is one_off  # the one-off saver stays idle
    with ckpt.CheckpointManager(tmp_root, {"model": torch.nn.Linear(3, 2)}) as again:
        assert again.resume() == 2
    assert [kind for kind, _ in seen] == ["save", "save", "load"]  # an empty root: no load
    first = {id(s.saver) for kind, s in seen[:2]}
    assert len(first) == 1 and async_save.default_saver() is not seen[0][1].saver
    assert all(s.partial_templates and s.on_event is not None for _, s in seen)
    assert "checkpoint_saved" in events, events  # the session's sink reached the user's callback


def test_the_one_off_functions_run_in_the_default_session(tmp_root):
    state = {"w": torch.arange(4.0)}
    pending = ckpt.save(state, tmp_root, 3, async_save=True)
    assert async_save.default_saver().pending is pending
    assert ckpt.close() == pending.url
    session = default_session()
    assert session.saver is async_save.default_saver() and not session.partial_templates
    into = {"w": torch.zeros(4)}
    assert ckpt.load(into, tmp_root).step == 3
    assert torch.equal(into["w"], state["w"])


def test_a_script_can_run_the_engine_in_a_session_of_its_own(tmp_root):
    from ckpt.loading.restore import load_in
    from ckpt.saving.commit import save_in

    events: list[str] = []
    own = Session(saver=async_save.AsyncSaver(), on_event=lambda e: events.append(e["event"]))
    pending = save_in(own, {"w": torch.ones(2)}, tmp_root, 5, async_save=True)
    assert own.saver.pending is pending and async_save.default_saver().pending is not pending
    into = {"w": torch.zeros(2)}
    assert load_in(own, into, tmp_root).step == 5  # waits for its own save in flight first
    assert torch.equal(into["w"], torch.ones(2))
    assert "ckpt_saved" in events and "ckpt_loaded" in events
    own.saver.close()
