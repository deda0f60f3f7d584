"""Training configuration: nested dataclasses loaded from TOML with ``--set`` overrides.

Each section (``model``, ``data``, ``optim``, ``checkpoint``, ``run``) is a keyword-only
dataclass that validates itself in ``__post_init__`` and raises ``ValueError`` naming the
offending key (``section.key``) and its value. Unknown sections and keys are errors, so a
typo in a TOML file or an override never silently trains something else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckpt.options import CheckpointOptions

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (pip install tomli)
    import tomli as tomllib


def _require(ok: bool, key: str, value: object, why: str) -> None:
    """Raise ``ValueError`` naming ``key`` and ``value`` unless ``ok``."""
    if not ok:
        raise ValueError(f"config {key}={value!r}: {why}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the decoder-only GPT."""

    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 64
    """Width of the residual stream."""
    seq_len: int = 64
    """Context length in tokens (each sample is ``seq_len + 1`` tokens)."""
    vocab_size: int = 0
    """Vocabulary size; 0 means take it from the data (the default corpus's alphabet)."""
    dropout: float = 0.0
    """Dropout probability; masks are derived from (seed, step, micro-batch index)."""
    bias: bool = True
    """Whether linear layers and layer norms carry a bias."""

    def __post_init__(self) -> None:
        _require(self.n_layer >= 1, "model.n_layer", self.n_layer, "must be >= 1")
        _require(self.n_head >= 1, "model.n_head", self.n_head, "must be >= 1")
        _require(self.d_model >= 1, "model.d_model", self.d_model, "must be >= 1")
        _require(
            self.d_model % self.n_head == 0,
            "model.d_model",
            self.d_model,
            f"must be divisible by model.n_head={self.n_head}",
        )
        _require(self.seq_len >= 1, "model.seq_len", self.seq_len, "must be >= 1")
        _require(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "must be >= 0")
        _require(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "must be in [0, 1)")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where samples come from and how they are ordered and batched."""

    source: str = "arithmetic"
    """``arithmetic`` (built-in corpus, no download) or a path/URL of a uint16 token file."""
    corpus_chars: int = 200_000
    """Length of the built-in corpus in characters."""
    seed: int = 1234
    """Seed of the corpus and of the per-epoch global sample order."""
    global_batch: int = 24
    """Samples per optimizer step, the same at every world size."""
    micro_batch: int = 2
    """Samples per forward/backward on one rank; accumulation = global / (world * micro)."""

    def __post_init__(self) -> None:
        _require(bool(self.source), "data.source", self.source, "must not be empty")
        _require(
            self.corpus_chars >= 1000, "data.corpus_chars", self.corpus_chars, "must be >= 1000"
        )
        _require(self.seed >= 0, "data.seed", self.seed, "must be >= 0")
        _require(self.global_batch >= 1, "data.global_batch", self.global_batch, "must be >= 1")
        _require(self.micro_batch >= 1, "data.micro_batch", self.micro_batch, "must be >= 1")
        _require(
            self.global_batch % self.micro_batch == 0,
            "data.global_batch",
            self.global_batch,
            f"must be a multiple of data.micro_batch={self.micro_batch}",
        )


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay, plus gradient clipping."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Steps of linear warmup from lr/warmup_steps to lr."""
    decay_steps: int = 200
    """Step at which the cosine reaches min_lr (constant afterwards)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _require(
            0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr, "must be in [0, optim.lr]"
        )
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(
            self.decay_steps >= self.warmup_steps,
            "optim.decay_steps",
            self.decay_steps,
            f"must be >= optim.warmup_steps={self.warmup_steps}",
        )
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        _require(0 <= self.beta1 < 1, "optim.beta1", self.beta1, "must be in [0, 1)")
        _require(0 <= self.beta2 < 1, "optim.beta2", self.beta2, "must be in [0, 1)")
        _require(self.eps > 0, "optim.eps", self.eps, "must be > 0")
        _require(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig(CheckpointOptions):
    """Where and how checkpoints are written: the library's
    :class:`~ckpt.options.CheckpointOptions` (every key, default and check is theirs: see
    their field docs) plus ``dir`` and ``resume``.

    One default differs: ``every`` is 50 here, 0 in the library. A library caller that
    says nothing gets no periodic save it did not ask for (a save costs what its state
    costs to write); a trainer run that says nothing should not lose more than 50 steps
    to a crash. ``setup_timeout_s`` unset (None) becomes the trainer's peer failure bound
    (``run.peer_timeout_s`` + 10 s) rather than ``CKPT_COLLECTIVE_TIMEOUT_S``.
    """

    _key_prefix: ClassVar[str] = "config checkpoint."

    dir: str = ""
    """Checkpoint root (local path, file://, memory://, gs://); empty disables checkpoints."""
    every: int = 50
    """Save every N optimizer steps (and at the last step); 0 saves only at the end."""
    resume: bool | str = True
    """true: resume from the newest committed checkpoint under ``dir`` when there is one
    (a WARNING says when there is none); false: start from step 0 (the root is still
    checked), while a torchrun restart of the same job resumes the checkpoints this job
    wrote; ``"must"``: resume, and fail (exit 1) when ``dir`` holds no committed
    checkpoint."""

    def __post_init__(self) -> None:
        CheckpointOptions.__post_init__(self)  # slots: the zero-argument super() is not bound
        _require(self.resume in (True, False, "must"), "checkpoint.resume", self.resume,
                 "must be true, false or \"must\"")  # fmt: skip


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Length of the run, outputs and runtime switches."""

    seed: int = 1234
    """Seed of the model initialization and of dropout."""
    max_steps: int = 200
    """Optimizer steps to train in total (counting steps done before a resume)."""
    run_dir: str = ""
    """Directory for metrics.jsonl and events.jsonl (rank 0); empty disables them."""
    log_every: int = 1
    """Log a line every N steps on rank 0."""
    deterministic: bool = True
    """Use deterministic kernels (needed for bitwise-identical resume)."""
    mixed_precision: str = "none"
    """``none`` or ``bf16`` (bf16 params/compute, fp32 reduction); bf16 applies on CUDA only."""
    save_final: bool = False
    """Write the full final parameters to ``run_dir/final_params.pt`` (rank 0)."""
    allow_resume_past_end: bool = False
    """Accept a launch whose resume lands at or past ``max_steps`` (nothing left to train)
    and exit 0; by default such a launch exits 1 saying so: the checkpoint may be another
    job's (a torchrun restart of this job that finds its own final step is always fine)."""
    watchdog_s: float | str = "auto"
    """Dump every stack and exit (code 124) when no step finishes for this many seconds;
    0 disables; ``"auto"`` (default): 10 x the median of the first timed steps, within
    [60, 600] s (600 s until then). Loads, saves and the first step get 900 s more."""
    peer_timeout_s: float = 5.0
    """Peer failure detector: leave (exit code 125) when a peer's heartbeat, or the TCP
    store that carries them, has been silent this long (a frozen node, a cut link), so
    torchrun restarts the group without it; 0 disables."""
    heartbeat_s: float = 0.25
    """Seconds between two heartbeats of the peer failure detector."""
    node_timeout_s: float = 1.0
    """Under ``--rdzv_backend=ft``: a peer whose heartbeat and whose node's keep-alive (its
    torchrun agent's) both stopped for this long is silent, well before
    ``peer_timeout_s``; 0: judge by heartbeats alone."""
    peer_stall_limit_s: float = 60.0
    """Under ``--rdzv_backend=ft``: a peer whose heartbeat stopped while its node's
    keep-alive goes on is stalled (a long garbage collection, a call that holds the GIL):
    said at WARNING and waited for this long before it counts as silent."""
    straggler_every: int = 0
    """Compare step times across ranks every N steps and record stragglers (0 disables)."""
    collective_timeout_s: float = 120.0
    """Timeout of training collectives: a dead or frozen peer becomes an error (and a
    restart) after this long instead of gloo's 30-minute default."""
    faults: list[str] = field(default_factory=list)
    """Fault injection specs (``KIND:step=S[:rank=R][:attempt=A]``, or ``at=POINT`` for a
    point of the start-up), see ``--fault``."""
    divergence: str = "stop"
    """A step whose loss is NaN or inf: ``stop`` (exit code 3, naming the step and the last
    checkpoint) or ``rollback`` (restore the newest checkpoint, skip the batches after it,
    train on; needs ``checkpoint.dir``)."""
    rollback_skip: int | str = "auto"
    """Global batches a rollback skips after the restored step; ``"auto"``: as many as were
    trained since it, the diverged step's included."""
    max_rollbacks: int = 3
    """Roll back at most this many times per attempt; the next divergence stops the run."""

    def __post_init__(self) -> None:
        _require(self.seed >= 0, "run.seed", self.seed, "must be >= 0")
        _require(self.max_steps >= 0, "run.max_steps", self.max_steps, "must be >= 0")
        _require(self.log_every >= 1, "run.log_every", self.log_every, "must be >= 1")
        _require(
            self.mixed_precision in ("none", "bf16"),
            "run.mixed_precision",
            self.mixed_precision,
            "must be 'none' or 'bf16'",
        )
        _require(
            self.straggler_every >= 0, "run.straggler_every", self.straggler_every, "must be >= 0"
        )
        if isinstance(self.watchdog_s, str):
            _require(
                self.watchdog_s == "auto",
                "run.watchdog_s",
                self.watchdog_s,
                "must be 'auto' or >= 0",
            )
        else:
            _require(self.watchdog_s >= 0, "run.watchdog_s", self.watchdog_s, "must be >= 0")
        _require(
            self.peer_timeout_s >= 0, "run.peer_timeout_s", self.peer_timeout_s, "must be >= 0"
        )
        _require(self.heartbeat_s > 0, "run.heartbeat_s", self.heartbeat_s, "must be > 0")
        _require(
            self.peer_timeout_s == 0 or self.peer_timeout_s >= 2 * self.heartbeat_s,
            "run.peer_timeout_s",
            self.peer_timeout_s,
            f"must be 0 (off) or at least 2 x run.heartbeat_s={self.heartbeat_s}",
        )
        _require(
            self.node_timeout_s == 0 or self.node_timeout_s >= 2 * self.heartbeat_s,
            "run.node_timeout_s",
            self.node_timeout_s,
            f"must be 0 (off) or at least 2 x run.heartbeat_s={self.heartbeat_s}",
        )
        _require(
            math.isfinite(self.peer_stall_limit_s)
            and self.peer_stall_limit_s >= max(self.node_timeout_s, self.peer_timeout_s),
            "run.peer_stall_limit_s",
            self.peer_stall_limit_s,
            "must be at least run.node_timeout_s and run.peer_timeout_s",
        )
        _require(
            self.collective_timeout_s > 0,
            "run.collective_timeout_s",
            self.collective_timeout_s,
            "must be > 0",
        )
        _require(self.divergence in ("stop", "rollback"), "run.divergence", self.divergence,
                 "must be 'stop' or 'rollback'")  # fmt: skip
        _require(self.rollback_skip == "auto" or (isinstance(self.rollback_skip, int)
                 and self.rollback_skip >= 0), "run.rollback_skip", self.rollback_skip,
                 "must be 'auto' or an integer >= 0")  # fmt: skip
        _require(self.max_rollbacks >= 0, "run.max_rollbacks", self.max_rollbacks, "must be >= 0")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The whole configuration of one training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        _require(self.run.divergence != "rollback" or bool(self.checkpoint.dir), "run.divergence",
                 self.run.divergence, "rollback restores a checkpoint: set checkpoint.dir")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form of the configuration."""
        return dataclasses.asdict(self)

    def section_digests(self) -> dict[str, str]:
        """Short digests of the sections that make a run what it is (model, data, optim),
        stored with checkpoints: a resume says which differ (another job's checkpoint?)."""
        return {
            name: hashlib.sha256(
                json.dumps(dataclasses.asdict(getattr(self, name)), sort_keys=True).encode()
            ).hexdigest()[:16]
            for name in ("model", "data", "optim")
        }

    def model_digest(self) -> str:
        """Short digest of the model section, stored with checkpoints for diagnosis."""
        blob = json.dumps(dataclasses.asdict(self.model), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "run": RunConfig,
}


MAX_SECONDS = 7 * 86400.0
"""The longest time setting (``*_s``): a week. torch's collectives take their timeout in
milliseconds as a C int (2^31 ms is 24.8 days); ``1e300`` overflowed the timedelta."""
MAX_FLOAT = 3.4028234663852886e38  # torch.finfo(torch.float32).max
"""The largest other number: the parameters' dtype (an lr of 1e308 overflowed Adam)."""
MAX_INT = 2**63 - 1
"""The largest integer setting (seeds and counts go to torch as int64)."""


def _finite(key: str, raw: object, value: float) -> float:
    """``value`` if finite and within what its use can hold: no setting of this trainer
    means anything with inf or nan (an lr of inf trains on NaN), and a time past
    :data:`MAX_SECONDS` or a number past :data:`MAX_FLOAT` overflows where it is used."""
    if not math.isfinite(value):
        raise ValueError(f"config {key}={raw!r}: must be a finite number")
    bound = MAX_SECONDS if key.endswith("_s") else MAX_FLOAT
    if abs(value) > bound:
        raise ValueError(f"config {key}={raw!r}: must be at most {bound:g} in size")
    return value


_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")
_BOOL_WORDS = _TRUE_WORDS + _FALSE_WORDS


def _coerce(key: str, raw: object, annotation: str) -> object:
    """Convert a TOML value or a ``--set`` string to the field's declared type."""
    text = raw if isinstance(raw, str) else None
    if annotation == "bool":
        if isinstance(raw, bool):
            return raw
        if text is not None and text.lower() in _TRUE_WORDS:
            return True
        if text is not None and text.lower() in _FALSE_WORDS:
            return False
        raise ValueError(f"config {key}={raw!r}: must be a boolean (true/false)")
    if annotation == "bool | str":  # checkpoint.resume: true, false or "must"
        if text is not None and text.strip().lower() == "must":
            return "must"
        try:
            return _coerce(key, raw, "bool")
        except ValueError:
            raise ValueError(f'config {key}={raw!r}: must be true, false or "must"') from None
    if annotation == "int":
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise ValueError(f"config {key}={raw!r}: must be an integer")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"config {key}={raw!r}: must be an integer") from None
        if abs(value) > MAX_INT:
            raise ValueError(f"config {key}={raw!r}: must be at most {MAX_INT} in size")
        return value
    if annotation == "float":
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise ValueError(f"config {key}={raw!r}: must be a number")
        try:
            value = float(raw)
        except (ValueError, OverflowError):
            raise ValueError(f"config {key}={raw!r}: must be a finite number") from None
        return _finite(key, raw, value)
    if annotation == "float | str":  # a number of seconds or the word "auto"
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise ValueError(f"config {key}={raw!r}: must be a number or 'auto'")
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return "auto"
        try:
            value = float(raw)
        except (ValueError, OverflowError):
            raise ValueError(f"config {key}={raw!r}: must be a finite number or 'auto'") from None
        return _finite(key, raw, value)
    if annotation == "int | str":  # a count or the word "auto"
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return "auto"
        try:
            return _coerce(key, raw, "int")
        except ValueError:
            raise ValueError(f"config {key}={raw!r}: must be an integer or 'auto'") from None
    if annotation in ("str | None", "float | None"):  # None is only ever the default
        return _coerce(key, raw, annotation.partition(" | ")[0])
    if annotation == "bool | tuple[str, ...]":  # checkpoint.allow_non_finite
        if isinstance(raw, bool) or (isinstance(raw, str) and raw.lower() in _BOOL_WORDS):
            return _coerce(key, raw, "bool")
        try:
            return tuple(typing.cast(list, _coerce(key, raw, "list[str]")))
        except ValueError:
            raise ValueError(
                f"config {key}={raw!r}: must be true, false or a list of key patterns"
            ) from None
    if annotation == "str":
        if not isinstance(raw, str):
            raise ValueError(f"config {key}={raw!r}: must be a string")
        return raw
    if annotation == "list[str]":
        if isinstance(raw, str):
            return [part for part in raw.split(";") if part]
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise ValueError(f"config {key}={raw!r}: must be a list of strings")
        return list(raw)
    raise ValueError(
        f"config {key}: set it in Python (ckpt.CheckpointOptions), not in a config file: its "
        f"type is {annotation}"
    )


def _field_types(cls: type) -> dict[str, str]:
    hints = typing.get_type_hints(cls)
    return {f.name: _annotation_name(hints[f.name]) for f in dataclasses.fields(cls)}


def _annotation_name(tp: object) -> str:
    if typing.get_origin(tp) is list:
        return "list[str]"
    return getattr(tp, "__name__", str(tp))


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build a validated ``TrainConfig`` from a nested mapping (parsed TOML).

    Raises ``ValueError`` for unknown sections or keys and for invalid values.
    """
    sections: dict[str, Any] = {}
    for name, values in raw.items():
        cls = _SECTIONS.get(name)
        if cls is None:
            raise ValueError(f"config: unknown section [{name}]; known: {sorted(_SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"config [{name}]={values!r}: must be a table")
        types = _field_types(cls)
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in types:
                raise ValueError(
                    f"config: unknown key {name}.{key}; known keys of [{name}]: {sorted(types)}"
                )
            kwargs[key] = _coerce(f"{name}.{key}", value, types[key])
        sections[name] = cls(**kwargs)
    return TrainConfig(**sections)


def parse_override(text: str) -> tuple[str, str, str]:
    """Split ``section.key=value`` into its three parts (``ValueError`` if malformed)."""
    lhs, sep, value = text.partition("=")
    section, dot, key = lhs.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ValueError(f"--set {text!r}: expected section.key=value, e.g. optim.lr=3e-4")
    return section, key, value.strip()


def load_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a TOML file (``None`` means all defaults) and apply ``section.key=value`` overrides.

    Overrides are applied to the raw mapping before validation, so a value that is only
    valid together with an override (e.g. global and micro batch) is checked once, whole.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError:
            raise ValueError(f"config file {path!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {path!r} is not valid TOML: {exc}") from None
    for text in overrides or []:
        section, key, value = parse_override(text)
        if section not in _SECTIONS:
            raise ValueError(
                f"--set {text!r}: unknown section {section!r}; known: {sorted(_SECTIONS)}"
            )
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ValueError(f"config [{section}] must be a table")
        table[key] = value
    return config_from_dict(raw)
