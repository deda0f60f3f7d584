"""Config parsing: TOML + --set overrides, type coercion, validation messages, CLI merge."""

from __future__ import annotations

import pytest

from trainer.cli import build_parser, config_from_args
from trainer.config import TrainConfig, config_from_dict, load_config, parse_override

pytestmark = pytest.mark.timeout(30)

EXAMPLE = "examples/tiny_gpt.toml"


def test_defaults_are_valid():
    cfg = TrainConfig()
    assert cfg.data.global_batch % cfg.data.micro_batch == 0
    assert cfg.checkpoint.dir == ""


def test_example_config_loads_and_fits_one_to_four_ranks():
    cfg = load_config(EXAMPLE)
    assert cfg.model.n_layer == 2
    for world in (1, 2, 3, 4):
        assert cfg.data.global_batch % (world * cfg.data.micro_batch) == 0


def test_overrides_are_typed_and_applied(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nn_layer = 3\n[optim]\nlr = 0.01\n")
    cfg = load_config(
        str(path),
        ["model.n_layer=5", "optim.lr=2e-4", "run.save_final=true", "checkpoint.dir=memory://x",
         "checkpoint.memory_every=2"],
    )  # fmt: skip
    assert cfg.checkpoint.memory_every == 2
    assert cfg.model.n_layer == 5
    assert cfg.optim.lr == pytest.approx(2e-4)
    assert cfg.run.save_final is True
    assert cfg.checkpoint.dir == "memory://x"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model": {"n_layers": 2}}, "unknown key model.n_layers"),
        ({"modle": {"n_layer": 2}}, "unknown section [modle]"),
        ({"model": {"n_layer": 0}}, "model.n_layer=0"),
        ({"model": {"d_model": 30, "n_head": 4}}, "model.d_model=30"),
        ({"model": {"n_layer": "two"}}, "model.n_layer='two'"),
        ({"model": {"dropout": 1.5}}, "model.dropout=1.5"),
        ({"optim": {"lr": -1.0}}, "optim.lr=-1.0"),
        ({"optim": {"warmup_steps": 10, "decay_steps": 5}}, "optim.decay_steps=5"),
        ({"data": {"global_batch": 10, "micro_batch": 4}}, "data.global_batch=10"),
        ({"run": {"mixed_precision": "fp8"}}, "run.mixed_precision='fp8'"),
        ({"run": {"deterministic": "maybe"}}, "run.deterministic='maybe'"),
        ({"run": {"max_steps": True}}, "run.max_steps=True"),
        ({"checkpoint": {"memory_every": -1}}, "checkpoint.memory_every=-1"),
    ],
)
def test_bad_config_names_key_and_value(raw, message):
    with pytest.raises(ValueError) as info:
        config_from_dict(raw)
    assert message in str(info.value)


@pytest.mark.parametrize("text", ["lr=3", "optim.lr", ".lr=3", "optim.=3"])
def test_malformed_override(text):
    with pytest.raises(ValueError, match=r"section\.key=value"):
        parse_override(text)


def test_override_unknown_section():
    with pytest.raises(ValueError, match="unknown section 'optimizer'"):
        load_config(None, ["optimizer.lr=1"])


def test_missing_and_invalid_toml(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(str(bad))


def test_cli_flags_override_set_and_file():
    args = build_parser().parse_args(
        [
            "--config", EXAMPLE,
            "--set", "run.max_steps=7",
            "--max-steps", "9",
            "--ckpt-dir", "/tmp/ck",
            "--ckpt-every", "3",
            "--run-dir", "/tmp/rd",
            "--fault", "kill:step=5:rank=1",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.run.max_steps == 9
    assert cfg.checkpoint.dir == "/tmp/ck"
    assert cfg.checkpoint.every == 3
    assert cfg.run.run_dir == "/tmp/rd"
    assert cfg.run.faults == ["kill:step=5:rank=1"]


def test_model_digest_tracks_model_section_only():
    a = config_from_dict({"model": {"n_layer": 2}, "optim": {"lr": 0.1}})
    b = config_from_dict({"model": {"n_layer": 2}, "optim": {"lr": 0.2}})
    c = config_from_dict({"model": {"n_layer": 3}})
    assert a.model_digest() == b.model_digest() != c.model_digest()


def test_the_checkpoint_section_takes_its_keys_defaults_and_checks_from_the_library():
    import dataclasses

    from ckpt.options import CheckpointOptions
    from trainer.config import CheckpointConfig

    section = {f.name: f for f in dataclasses.fields(CheckpointConfig)}
    library = {f.name: f for f in dataclasses.fields(CheckpointOptions)}
    assert set(section) == set(library) | {"dir", "resume"}
    own = {"dir", "resume", "every"}  # every: 50 here (see CheckpointConfig), 0 in the library
    declared_here = set(CheckpointConfig.__annotations__) - {"_key_prefix"}
    assert declared_here == own  # no library default written a second time
    defaults = CheckpointConfig()
    for name in set(library) - own:
        assert getattr(defaults, name) == getattr(CheckpointOptions(), name), name
    assert defaults.every == 50 and CheckpointOptions().every == 0
    assert defaults.options() == CheckpointOptions(every=50)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"keep_last": -1}, "config checkpoint.keep_last=-1: must be an int >= 0"),
        ({"max_failures": -2}, "config checkpoint.max_failures=-2"),
        ({"param_groups": "newest"}, "config checkpoint.param_groups='newest'"),
        ({"lease_ttl_s": -5}, "config checkpoint.lease_ttl_s=-5.0"),
        ({"resume": "maybe"}, "config checkpoint.resume='maybe'"),
    ],
)
def test_a_bad_checkpoint_key_is_refused_by_the_library_check_with_the_config_key(raw, message):
    with pytest.raises(ValueError) as info:
        config_from_dict({"checkpoint": raw})
    assert message in str(info.value)


def test_the_library_options_are_config_keys(tmp_path):
    cfg = load_config(None, ["checkpoint.allow_non_finite=model.*.mask;optim.*",
                             "checkpoint.lease_ttl_s=0", "checkpoint.param_groups=constructed",
                             "checkpoint.memory_dir=/dev/shm/x"])  # fmt: skip
    options = cfg.checkpoint.options()
    assert options.allow_non_finite == ("model.*.mask", "optim.*")
    assert (options.lease_ttl_s, options.param_groups) == (0.0, "constructed")
    assert options.memory_dir == "/dev/shm/x"
    assert load_config(None, ["checkpoint.allow_non_finite=true"]).checkpoint.allow_non_finite


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("optim.lr=1e308", "optim.lr='1e308': must be at most"),
        ("run.collective_timeout_s=1e300", "run.collective_timeout_s='1e300': must be at most"),
        ("run.heartbeat_s=1e9", "run.heartbeat_s='1e9': must be at most"),
        ("run.seed=99999999999999999999999", "run.seed='99999999999999999999999': must be at most"),
        ("data.seed=-99999999999999999999999", "data.seed="),
    ],
)
def test_a_number_that_would_overflow_where_it_is_used_is_refused_naming_the_key(override, said):
    with pytest.raises(ValueError, match="must be at most") as err:
        config_from_args(build_parser().parse_args(["--set", override]))
    assert said in str(err.value)


def test_the_largest_sane_settings_still_parse():
    cfg = config_from_args(build_parser().parse_args(
        ["--set", "run.collective_timeout_s=604800", "--set", "optim.lr=1e30"]
    ))  # fmt: skip
    assert cfg.run.collective_timeout_s == 604800.0 and cfg.optim.lr == 1e30
