"""The tier seam: a manager holds an ordered list of tiers it knows only through the
``ckpt.tiers.Tier`` protocol, so a new tier is a class and a builder, never an edit of
the manager.

The third tier here is a real, small one: a mirror that saves each due step with
``ckpt.save`` under a second root and offers its newest step newer than the durable head
on resume. It sits between the memory tier and the durable root.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.saving.policy import EveryNSteps
from ckpt.tiers import Candidate, ResumeScope, SaveRequest, TierContext, manager_record
from ckpt.tiers.defaults import DEFAULT_TIERS
from ckpt.tiers.durable import build_durable_tier
from ckpt.tiers.memory.snapshots import build_memory_tier
from runcore import events as ev

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


class RecordingPolicy:
    """``EveryNSteps`` that remembers each question, to show the manager asks every step."""

    def __init__(self, every: int) -> None:
        self.inner = EveryNSteps(every, at_final=False)
        self.asked: list[tuple[int, bool]] = []

    def should_save(self, step: int, *, final: bool) -> bool:
        self.asked.append((step, final))
        return self.inner.should_save(step, final=final)


class MirrorTier:
    """A tier that keeps full checkpoints under a second root (one process)."""

    name = "mirror"
    strict = False

    def __init__(self, root: str, every: int) -> None:
        self.root = root
        self.policy = RecordingPolicy(every)
        self.timings: dict[str, float] = {}
        self.saved: list[int] = []
        self.offered: list[int] = []
        self.loaded: list[int] = []
        self.ended: list[str] = []
        self.closed_with: list[int | None] = []

    def save(self, request: SaveRequest) -> str | None:
        state, metadata, _ = request.capture()
        url = ckpt.save(state, self.root, request.step, metadata=metadata)
        self.saved.append(request.step)
        return url

    def candidates(self, scope: ResumeScope) -> list[Candidate]:
        info = ckpt.find_latest_committed(self.root)
        if info is None or (scope.head is not None and info.step <= scope.head.step):
            return []
        self.offered.append(info.step)
        manifest = info.manifest
        record = manager_record(manifest.metadata)
        return [Candidate(info.step, manifest.world_size, record, url=info.url)]

    def load(self, cand: Candidate, template, want_rng: bool, scope: ResumeScope):
        result = ckpt.load(template, self.root, step=cand.step)
        self.loaded.append(cand.step)
        return result, want_rng

    def url(self, result) -> str:
        return result.url

    def resumed(self, cand: Candidate) -> None:
        self.ended.append(f"resumed {cand.step}")

    def exhausted(self) -> None:
        self.ended.append("exhausted")

    def close(self, durable_step: int | None, timeout: float | None) -> None:
        self.closed_with.append(durable_step)


def _mirror_builder(root: str, every: int, built: list[MirrorTier]):
    def build(ctx: TierContext) -> MirrorTier:
        tier = MirrorTier(root, every)
        built.append(tier)
        return tier

    return build


def _model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model, optim) -> None:
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()


def _manager(tmp_path, model, optim, built, events=None, memory="node"):
    tiers = (build_memory_tier, _mirror_builder(str(tmp_path / "mirror"), 3, built),
             build_durable_tier)  # fmt: skip
    options = ckpt.CheckpointOptions(
        every=4, memory_every=2, memory_dir=str(tmp_path / memory), lease_ttl_s=0
    )
    on_event = None if events is None else (lambda name, step, **f: events.append((name, f)))
    return ckpt.CheckpointManager(
        str(tmp_path / "root"),
        {"model": model, "optim": optim},
        options=options,
        tiers=tiers,
        on_event=on_event,
    )


def test_a_third_tier_is_asked_at_every_step_saves_when_due_and_is_closed(tmp_path):
    built: list[MirrorTier] = []
    model, optim = _model(0)
    manager = _manager(tmp_path, model, optim, built)
    assert [t.name for t in manager.tiers] == ["memory", "mirror", "durable"]
    mirror = built[0]
    assert manager.tier("mirror") is mirror
    for step in range(1, 8):
        _train(model, optim)
        manager.maybe_save(step, final=step == 7)
    manager.close()
    assert mirror.policy.asked == [(s, s == 7) for s in range(1, 8)]
    assert mirror.saved == [3, 6]  # not the final step: its policy says so
    assert sorted(i.step for i in ckpt.list_checkpoints(str(tmp_path / "mirror"))) == [3, 6]
    assert sorted(i.step for i in ckpt.list_checkpoints(str(tmp_path / "root"))) == [4, 7]
    assert mirror.closed_with == [7]  # after the durable tier: told its last commit
    manager.close()
    assert mirror.closed_with == [7]  # closed once


def test_a_resume_walks_the_tiers_in_order_and_loads_from_the_third_one(tmp_path):
    built: list[MirrorTier] = []
    model, optim = _model(0)
    manager = _manager(tmp_path, model, optim, built)
    weights = {}
    for step in range(1, 8):
        _train(model, optim)
        manager.maybe_save(step)
        weights[step] = model.weight.detach().clone()
    manager.close()
    # memory 2/4/6, mirror 3/6, durable 4: the node lost its memory snapshots
    shutil.rmtree(tmp_path / "node")

    events: list[tuple[str, dict]] = []
    model2, optim2 = _model(1)
    again: list[MirrorTier] = []
    manager = _manager(tmp_path, model2, optim2, again, events)
    assert manager.resume() == 6
    mirror = again[0]
    assert mirror.offered == [6] and mirror.loaded == [6]
    assert mirror.ended == ["resumed 6"]
    assert manager.last_resume.tier == "mirror"
    assert torch.equal(model2.weight, weights[6])
    choice = [f for name, f in events if name == ev.TIER_CHOICE]
    assert choice[-1]["tier"] == "mirror"
    assert choice[-1]["reason"].startswith("mirror step 6 newer than durable 4")
    assert choice[-1]["durable_step"] == 4
    manager.close()
    assert mirror.closed_with == [4]


def _run_then_restart(tmp_path, steps: int) -> tuple[ckpt.CheckpointManager, MirrorTier]:
    """Train and save ``steps`` steps, close; a new manager (and mirror) on the same roots."""
    model, optim = _model(0)
    manager = _manager(tmp_path, model, optim, [])
    for step in range(1, steps + 1):
        _train(model, optim)
        manager.maybe_save(step)
    manager.close()
    built: list[MirrorTier] = []
    model2, optim2 = _model(1)
    return _manager(tmp_path, model2, optim2, built), built[0]


def test_a_newer_memory_snapshot_is_tried_before_the_third_tier(tmp_path):
    # memory 2/4/6 (kept at close: newer than durable 4), mirror 3/6, durable 4
    manager, mirror = _run_then_restart(tmp_path, 7)
    assert manager.resume() == 6 and manager.last_resume.tier == "memory"
    assert mirror.offered == [] and mirror.ended == []  # never reached
    manager.close()


def test_a_third_tier_not_newer_than_the_durable_head_offers_nothing(tmp_path):
    # durable 8 is the newest of all (the memory tier drops its snapshots at close)
    manager, mirror = _run_then_restart(tmp_path, 8)
    assert manager.resume() == 8 and manager.last_resume.tier == "durable"
    assert mirror.offered == [] and mirror.ended == ["exhausted"]
    manager.close()


def test_the_tier_list_needs_one_strict_tier_last_and_distinct_names(tmp_path):
    model, _ = _model(0)
    root = str(tmp_path / "root")
    mirror = _mirror_builder(str(tmp_path / "mirror"), 3, [])
    with pytest.raises(ValueError, match="exactly one strict tier"):
        ckpt.CheckpointManager(root, {"model": model}, tiers=(build_durable_tier, mirror),
                               lease_ttl_s=0)  # fmt: skip
    with pytest.raises(ValueError, match="its own name"):
        ckpt.CheckpointManager(root, {"model": model}, tiers=(mirror, mirror, build_durable_tier),
                               lease_ttl_s=0)  # fmt: skip


def test_the_default_tiers_are_memory_then_durable():
    assert (build_memory_tier, build_durable_tier) == DEFAULT_TIERS


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_manager_imports_no_tier_module():
    imported = _imported_modules(REPO / "ckpt" / "manager.py")
    tier_modules = {"ckpt.tiers.memory", "ckpt.tiers.durable"}
    found = {m for m in imported if any(m == t or m.startswith(t + ".") for t in tier_modules)}
    assert found == set(), found
    assert "ckpt.tiers.defaults" in imported  # the list of tiers it builds by default
