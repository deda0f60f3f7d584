"""``ckpt.CheckpointOptions``: every manager setting validated in one place, the manager's
keyword arguments building the same object, and the save-decision policy table."""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
from ckpt.options import CheckpointOptions
from ckpt.root.retention import DEFAULT_RETENTION, RetentionPolicy
from ckpt.saving.policy import EveryNSteps, SaveDecisionPolicy

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("every", -1, "every=-1: must be an int >= 0"),
        ("every", 2.5, "every=2.5: must be an int"),
        ("every", True, "every=True: must be an int"),
        ("keep_last", -3, "keep_last=-3: must be an int >= 0 (0 keeps every checkpoint)"),
        ("keep_every", "10", "keep_every='10': must be an int"),
        ("max_failures", -1, "max_failures=-1: must be an int >= 0"),
        ("memory_every", -2, "memory_every=-2: must be an int >= 0 (0: no memory tier)"),
        ("async_save", "yes", "async_save='yes': must be true or false"),
        ("memory_dir", "", "memory_dir='': must be a non-empty path"),
        ("param_groups", "latest", "param_groups='latest': must be one of checkpoint, constructed"),
        ("allow_non_finite", 3, "allow_non_finite=3"),
        ("setup_timeout_s", 0, "setup_timeout_s=0: must be seconds > 0"),
        ("setup_timeout_s", math.inf, "setup_timeout_s=inf: must be seconds > 0"),
        ("lease_ttl_s", -1, "lease_ttl_s=-1: must be seconds in [0, 86400]"),
        ("lease_ttl_s", 86401, "lease_ttl_s=86401: must be seconds in [0, 86400]"),
        ("lease_ttl_s", math.nan, "lease_ttl_s=nan"),
    ],
)
def test_a_bad_option_is_refused_naming_the_option_and_its_value(field, value, message):
    with pytest.raises(ValueError) as info:
        CheckpointOptions(**{field: value})
    assert message in str(info.value)
    with pytest.raises(ValueError) as info:  # the manager's keyword arguments: the same check
        ckpt.CheckpointManager("/tmp/unused-root", {}, **{field: value})
    assert message in str(info.value)


def test_the_defaults_are_the_managers_documented_ones():
    options = CheckpointOptions()
    assert (options.every, options.async_save, options.max_failures, options.memory_every) == (
        0, False, 3, 0)  # fmt: skip
    assert options.retention() == DEFAULT_RETENTION  # keep the newest 3
    assert (options.lease_ttl_s, options.setup_timeout_s, options.memory_dir) == (None,) * 3
    assert options.param_groups == "checkpoint" and options.allow_non_finite is False


def test_patterns_of_non_finite_keys_are_kept_as_a_tuple():
    options = CheckpointOptions(allow_non_finite=["model.*.mask"])
    assert options.allow_non_finite == ("model.*.mask",)


@pytest.mark.parametrize(
    ("retention", "keep_last", "keep_every", "policy"),
    [
        (None, 0, 0, None),
        (RetentionPolicy(keep_last=5), 5, 0, RetentionPolicy(keep_last=5)),
        (RetentionPolicy(keep_last=2, keep_every=100), 2, 100,
         RetentionPolicy(keep_last=2, keep_every=100)),
    ],
)  # fmt: skip
def test_the_retention_argument_becomes_keep_last_and_keep_every(
    retention, keep_last, keep_every, policy
):
    options = CheckpointOptions.from_kwargs(retention=retention)
    assert (options.keep_last, options.keep_every) == (keep_last, keep_every)
    assert options.retention() == policy


def test_a_retention_policy_the_manager_cannot_honour_is_refused():
    with pytest.raises(ValueError, match=r"retention=.*keep_last and keep_every only"):
        CheckpointOptions.from_kwargs(retention=RetentionPolicy(keep_last=2, delete_partial=False))
    with pytest.raises(ValueError, match=r"retention='3': must be a ckpt\.RetentionPolicy"):
        CheckpointOptions.from_kwargs(retention="3")


def test_an_unknown_keyword_argument_is_a_type_error_listing_the_options():
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*evry.*every"):
        ckpt.CheckpointManager("/tmp/unused-root", {}, evry=5)


def test_options_and_keyword_arguments_are_not_mixed():
    with pytest.raises(ValueError, match=r"options= and the keyword argument.*every"):
        ckpt.CheckpointManager("/tmp/unused-root", {}, options=CheckpointOptions(), every=5)
    with pytest.raises(ValueError, match=r"options must be a ckpt\.CheckpointOptions"):
        ckpt.CheckpointManager("/tmp/unused-root", {}, options={"every": 5})


def test_keyword_arguments_and_an_options_object_build_the_same_manager(tmp_path):
    model = torch.nn.Linear(2, 2)
    kwargs = {"every": 2, "async_save": True, "max_failures": 5, "lease_ttl_s": 0,
              "retention": RetentionPolicy(keep_last=4, keep_every=10)}  # fmt: skip
    by_kwargs = ckpt.CheckpointManager(str(tmp_path / "a"), {"model": model}, **kwargs)
    options = CheckpointOptions(every=2, async_save=True, max_failures=5, lease_ttl_s=0,
                                keep_last=4, keep_every=10)  # fmt: skip
    by_options = ckpt.CheckpointManager(str(tmp_path / "b"), {"model": model}, options=options)
    try:
        assert by_kwargs.options == by_options.options == options
        for manager in (by_kwargs, by_options):
            assert manager.retention == RetentionPolicy(keep_last=4, keep_every=10)
            assert manager.max_failures == 5 and manager.lease is None
            assert [manager.due(s) for s in range(1, 5)] == [False, True, False, True]
    finally:
        by_kwargs.close()
        by_options.close()


@pytest.mark.parametrize(
    ("every", "at_final", "step", "final", "due"),
    [
        (4, True, 4, False, True),
        (4, True, 8, False, True),
        (4, True, 6, False, False),
        (4, True, 6, True, True),  # the last step is saved whatever its number
        (4, False, 6, True, False),  # a tier that leaves the last step to another
        (4, False, 8, True, False),
        (0, True, 4, False, False),  # 0: never periodically
        (0, True, 5, True, True),
        (1, True, 3, False, True),
    ],
)
def test_every_n_steps_decides_when_a_save_is_due(every, at_final, step, final, due):
    policy = EveryNSteps(every, at_final=at_final)
    assert isinstance(policy, SaveDecisionPolicy)
    assert policy.should_save(step, final=final) is due


@pytest.mark.parametrize("every", [-1, 1.5, True])
def test_every_n_steps_refuses_a_bad_interval(every):
    with pytest.raises(ValueError, match=f"every={every!r}"):
        EveryNSteps(every)


def test_the_managers_option_attributes_read_the_options(tmp_path):
    state = {"w": torch.zeros(2)}
    with ckpt.CheckpointManager(
        str(tmp_path), state, every=7, async_save=True, memory_every=0, param_groups="constructed"
    ) as manager:
        assert (manager.every, manager.async_save, manager.memory_every) == (7, True, 0)
        assert manager.param_groups == "constructed" == manager.options.param_groups
