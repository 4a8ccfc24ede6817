"""One config schema: nested dataclasses loaded from YAML, then ``--set a.b=c`` overrides.

Each component receives only its own sub-config (``cfg.model``, ``cfg.parallel`` ...).
Unknown keys are errors that name the key; values are converted to the declared
field type so that ``--set train.lr_scale=2`` and a YAML ``2`` mean the same thing.
The resolved config is written into every run directory (:func:`dump_config`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megaformer.errors import ConfigError, interval
from megaformer.files import atomic_write_text


@dataclass
class ModelConfig:
    d_model: int = 512
    d_ff: int = 2048
    num_heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    dropout: float = 0.1  # residual dropout and the embedding + position sum
    attention_dropout: float = 0.0  # on attention probabilities (not used in the paper)
    activation_dropout: float = 0.0  # inside the feed-forward network (not used in the paper)
    norm: str = "post"  # "post": LayerNorm(x + Sublayer(x)) as in the paper; "pre": x + Sublayer(LayerNorm(x))
    layernorm_eps: float = 1e-5
    max_positions: int = 1024
    activation_checkpointing: bool = False  # recompute each layer in backward


# model.* settings that change how a model trains, not the function its weights compute: a resume
# may change them, and checkpoints that differ only in them average. Every other model.* setting
# (widths, heads, layers, norm, eps, positions) must match the checkpoint's.
TRAINING_ONLY_MODEL_SETTINGS = frozenset(
    {"dropout", "attention_dropout", "activation_dropout", "activation_checkpointing"}
)


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size: heads and d_ff are split over this many ranks
    dp: int = 0  # data-parallel size; 0 = world size / (tp x pp)
    pp: int = 1  # pipeline stages: encoder then decoder layers cut into this many stages (ranks: TP, then DP, then PP)
    pp_split: str = ""  # layers per stage, encoder layers first, e.g. "3,3,2"; "" = balanced by estimated cost
    sequence_parallel: bool = False  # split LayerNorm / dropout regions along the sequence
    dropout_rng: str = "exact"  # "exact": masks independent of tp; "fast": per-rank masks on split tensors
    vocab_multiple: int = 128  # vocabulary padded to a multiple of lcm(this, tp * 8)
    # Each training and validation batch's source and target lengths padded to a multiple of this (1 = as
    # long as its longest sentence). Dropout masks are drawn at the padded shape, so runs that must match
    # (another TP size, sequence parallelism, a resume) need the same value; sequence parallelism at tp=N
    # pads to a multiple of N and needs this a multiple of N with dropout_rng: exact.
    pad_to_multiple: int = 1
    backend: str = "auto"  # "auto" = nccl with CUDA, gloo otherwise
    device: str = "auto"  # "auto": a GPU with nccl, the CPU with gloo; "cuda" (also with gloo) or "cpu"
    timeout_minutes: float = 10.0  # a collective waiting longer fails (a lost rank ends the job instead of a hang)


@dataclass
class DataConfig:
    path: str = ""  # directory written by `megaformer prepare` (holds manifest.json)
    # The direction of the prepared data (its manifest): "" takes it; a language given must be the data's.
    src_lang: str = ""
    tgt_lang: str = ""
    vocab_size: int = 8000  # used when no prepared data gives the real size
    max_tokens: int = 4096  # per micro-batch and side, counting padding
    max_len: int = 256  # longest sentence in tokens kept by prepare and streaming
    shuffle_buffer: int = 10000  # a sample moves up to this many places in the read order (seeded per epoch)
    sort_buffer: int = 100000  # samples sorted by length together and cut into batches (memory: ~300 bytes each)
    num_workers: int = 1
    seed: int = 1234


@dataclass
class TrainConfig:
    precision: str = "fp32"  # fp32 | bf16 | fp16
    # auto | lean | deepspeed; auto: train/lean.py's engine at dp=1 pp=1 in fp32 or bf16 on a GPU, else DeepSpeed
    optimizer: str = "auto"
    zero_stage: int = 1  # DeepSpeed's
    tokens_per_step: int = 25000  # target tokens (per side) per optimizer step, all DP ranks together
    max_steps: int = 100000
    max_minutes: float = 0.0  # also stop (and save) after this much training time; 0 = no limit
    lr_scale: float = 1.0  # lrate = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup_steps: int = 4000
    # The last this fraction of the run (of train.max_minutes when that ends it first, else of
    # train.max_steps) ramps the lr linearly down to 0; the run ends with the ramp. 0 = off.
    cooldown_fraction: float = 0.0
    # > 0 with train.max_minutes: warm up over this share of the updates the run is expected to
    # reach at its measured step rate, at most warmup_steps, to the same peak lr (train/budget.py).
    warmup_fraction: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    clip_grad: float = 0.0  # 0 = no clipping
    label_smoothing: float = 0.1
    seed: int = 1
    log_interval: int = 100
    eval_interval: int = 1000
    # Greedy BLEU on the first this many validation sentences at each evaluation (best: RUN/checkpoints/best)
    eval_bleu_sentences: int = 200  # 0 = off
    eval_bleu_tokenized: bool = False  # also the paper's tokenized compound-split BLEU (decode/evaluate.py)
    save_interval: int = 1000  # steps; 0 = only on signals and at the end
    save_minutes: float = 0.0  # also save every this many minutes; 0 = off
    keep_last: int = 5
    fp16_initial_scale_power: int = 16  # dynamic loss scale starts at 2^this
    fp16_hysteresis: int = 2  # overflows tolerated before the loss scale is lowered
    # ZeRO communication (benchmarks/zero_overhead.py measures them against ZeRO-0):
    zero_bucket_size: int = 50_000_000  # elements per reduce / all-gather bucket (DeepSpeed's default: 5e8)
    zero_overlap_comm: bool = False  # overlap ZeRO's gradient reduction with backward (GPU streams; not bf16 ZeRO-1)
    zero_reduce_scatter: bool = True  # ZeRO-2 reduces gradients by reduce-scatter (else all-reduce)
    # Copy gradients into one buffer as backward produces them: saves fragmentation on a GPU,
    # costs a copy on a CPU. auto = on with CUDA, off on CPU.
    zero_contiguous_gradients: str = "auto"
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = known GPU table, or measured on a CPU
    # torch.compile each encoder and decoder layer (regional compilation; the first steps compile):
    # true | false | auto (compiled where the measured gain repays the compile time within
    # train.max_minutes: megaformer.train.budget.compile_choice; the log says which and why).
    compile: str = "false"
    # Profile steps profile_from .. profile_from + profile_steps - 1 with torch.profiler (0 = off):
    # RUN_DIR/profile/trace-rank*.json, and a line with the GPU's busy share and the top kernels.
    profile_from: int = 0
    profile_steps: int = 5


@dataclass
class DecodeConfig:
    beam: int = 4
    lenpen: float = 0.6  # ((5 + |Y|) / 6) ** lenpen
    max_len_a: float = 1.0  # maximum output length = a * source length + b
    max_len_b: int = 50
    average_last: int = 5  # checkpoints `megaformer average --run-dir` averages when --last is not given
    max_tokens: int = 4096  # source tokens per decoding batch, padding included (data.max_tokens is for training)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


_CHOICES = {
    ("model", "norm"): ("post", "pre"),
    ("parallel", "dropout_rng"): ("exact", "fast"),
    ("parallel", "backend"): ("auto", "nccl", "gloo"),
    ("parallel", "device"): ("auto", "cpu", "cuda"),
    ("train", "precision"): ("fp32", "bf16", "fp16"),
    ("train", "optimizer"): ("auto", "deepspeed", "lean"),
    ("train", "zero_stage"): (0, 1, 2),
    ("train", "zero_contiguous_gradients"): ("auto", "true", "false"),
    ("train", "compile"): ("auto", "true", "false"),
}


def _convert(value: Any, kind: Any, key: str) -> Any:
    """Convert a YAML or command-line value to the declared field type.

    A boolean is not a number here (YAML's ``true`` would otherwise be ``1``), and an
    integer field takes only whole numbers ("25000", "2.5e4", 25000.0).
    """
    if value is None:  # YAML's null (`key:` with nothing after it) is no value of any field
        raise ConfigError(
            f"{key}: empty (YAML null): give it a {kind.__name__} value, or leave the key out for its default"
        )
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if kind is str and isinstance(value, bool):  # YAML reads `true` as a boolean
        return "true" if value else "false"
    if kind in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key}: expected {kind.__name__}, got the boolean {str(value).lower()}")
    if kind in (int, float, str):
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            if kind is int and isinstance(value, str):
                number = float(value)  # accepts "25000" and "2.5e4"
                if not number.is_integer():
                    raise ValueError(value)
                return int(number)
            return kind(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    return value


def _apply(obj: Any, values: dict, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ConfigError(f"unknown config key '{key}' (known: {', '.join(sorted(names))})")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{key}: expected a mapping of {', '.join(sorted(f.name for f in dataclasses.fields(current)))}"
                )
            _apply(current, value, key + ".")
        else:
            setattr(obj, name, converted := _convert(value, hints[name], key))  # no field is Optional: null is refused
            if (bounds := RANGES.get(tuple(key.split(".")))) and not isinstance(converted, bool):
                _check_range(key, converted, bounds, shown=value)  # as typed: "1e309", not the inf it reads as


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set model.num_heads=16")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML; quote it, e.g. {key}='{raw}'") from None
    return key.strip().split("."), value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it keeps the last without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a :class:`Config` from defaults, then a YAML file, then ``a.b=c`` overrides; validate it."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            values = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}  # a SafeLoader: no objects built
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}): a config is a YAML file in UTF-8") from None
        except yaml.YAMLError as err:  # one line: the problem and where, not PyYAML's multi-line picture
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        try:
            _apply(cfg, values, "")
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
    for text in overrides:
        keys, value = _parse_override(text)
        nested: dict = {keys[-1]: value}
        for k in reversed(keys[:-1]):
            nested = {k: nested}
        _apply(cfg, nested, "")
    validate(cfg)
    check_training_lengths(cfg)
    return cfg


def check_training_lengths(cfg: Config) -> None:
    """The longest training sentence (data.max_len tokens and its eos, or bos and its tokens) has a position.

    Checked for a config a user gives (:func:`load_config`), not for one read back from a
    checkpoint (:func:`from_dict`): decoding a model needs only its own model.max_positions.
    """
    need = cfg.data.max_len + 1
    if cfg.model.max_positions < need:
        raise ConfigError(
            f"model.max_positions={cfg.model.max_positions} is below data.max_len={cfg.data.max_len} + 1: a "
            f"training sentence of data.max_len tokens with its eos needs {need} positions; raise "
            f"model.max_positions to at least {need} or lower data.max_len to {cfg.model.max_positions - 1}"
        )


# The range of every number in the config: (low, high, low excluded, high excluded); None = unbounded.
# tests/test_config.py fails for a numeric field missing here, so a new setting cannot join unchecked.
_INF = None
RANGES: dict[tuple[str, str], tuple[float | None, float | None, bool, bool]] = {
    ("model", "d_model"): (1, _INF, False, False),  # the largest weight is bounded by _check_shapes
    ("model", "d_ff"): (1, _INF, False, False),
    ("model", "num_heads"): (1, _INF, False, False),
    ("model", "encoder_layers"): (1, _INF, False, False),
    ("model", "decoder_layers"): (1, _INF, False, False),
    ("model", "dropout"): (0.0, 1.0, False, True),
    ("model", "attention_dropout"): (0.0, 1.0, False, True),
    ("model", "activation_dropout"): (0.0, 1.0, False, True),
    ("model", "layernorm_eps"): (0.0, 1.0, True, False),
    ("model", "max_positions"): (2, _INF, False, False),  # bos + at least one token
    ("parallel", "tp"): (1, _INF, False, False),
    ("parallel", "dp"): (0, _INF, False, False),  # 0 = world size / (tp x pp)
    ("parallel", "pp"): (1, _INF, False, False),
    ("parallel", "vocab_multiple"): (1, _INF, False, False),
    ("parallel", "pad_to_multiple"): (1, 4096, False, False),
    # > 0: a collective may wait this long; at most a week (Python's timedelta ends at 1.4e12 minutes)
    ("parallel", "timeout_minutes"): (0, 7 * 24 * 60, True, False),
    ("data", "vocab_size"): (4, _INF, False, False),  # pad, unk, bos, eos
    ("data", "max_tokens"): (1, _INF, False, False),
    ("data", "max_len"): (1, _INF, False, False),
    ("data", "shuffle_buffer"): (0, _INF, False, False),  # 0 or 1 = no shuffling
    ("data", "sort_buffer"): (1, _INF, False, False),
    ("data", "num_workers"): (0, _INF, False, False),
    ("data", "seed"): (0, 2**32 - 1, False, False),  # numpy seeds are unsigned 32-bit
    ("train", "zero_stage"): (0, 2, False, False),
    ("train", "tokens_per_step"): (1, _INF, False, False),
    ("train", "max_steps"): (1, _INF, False, False),
    ("train", "max_minutes"): (0.0, _INF, False, False),  # 0 = no limit
    ("train", "lr_scale"): (0.0, _INF, True, False),
    ("train", "warmup_steps"): (1, _INF, False, False),  # step * warmup^-1.5 divides by it
    ("train", "cooldown_fraction"): (0.0, 1.0, False, True),  # 0 = off; 1 would leave no run before it
    ("train", "warmup_fraction"): (0.0, 1.0, False, False),  # 0 = train.warmup_steps as set
    ("train", "adam_beta1"): (0.0, 1.0, False, True),
    ("train", "adam_beta2"): (0.0, 1.0, False, True),
    ("train", "adam_eps"): (0.0, _INF, True, False),
    ("train", "weight_decay"): (0.0, _INF, False, False),
    ("train", "clip_grad"): (0.0, _INF, False, False),  # 0 = no clipping
    ("train", "label_smoothing"): (0.0, 1.0, False, True),
    ("train", "seed"): (0, 2**32 - 1, False, False),
    ("train", "log_interval"): (1, _INF, False, False),
    ("train", "eval_interval"): (0, _INF, False, False),  # 0 = no evaluation
    ("train", "eval_bleu_sentences"): (0, _INF, False, False),  # 0 = no BLEU during training
    ("train", "save_interval"): (0, _INF, False, False),  # 0 = only on signals and at the end
    ("train", "save_minutes"): (0.0, _INF, False, False),
    ("train", "keep_last"): (0, _INF, False, False),  # 0 = keep every checkpoint
    ("train", "fp16_initial_scale_power"): (0, 63, False, False),
    ("train", "fp16_hysteresis"): (1, _INF, False, False),
    ("train", "zero_bucket_size"): (1, _INF, False, False),
    ("train", "peak_tflops"): (0.0, _INF, False, False),  # 0 = known table or measured
    ("train", "profile_from"): (0, _INF, False, False),  # 0 = no profile
    ("train", "profile_steps"): (1, 1000, False, False),  # a trace of every op: keep it short
    ("decode", "beam"): (1, _INF, False, False),
    ("decode", "lenpen"): (0.0, _INF, False, False),
    # a * source length + b in an int64; the output is capped at model.max_positions - 1 anyway
    ("decode", "max_len_a"): (0.0, 1000.0, False, False),
    ("decode", "max_len_b"): (0, 1_000_000, False, False),
    ("decode", "average_last"): (1, _INF, False, False),
    ("decode", "max_tokens"): (1, _INF, False, False),
}


def check_precision(train: TrainConfig) -> None:
    """bf16 and fp16 train through DeepSpeed's ZeRO optimizer, which holds the fp32 master weights (or
    bf16 through the lean engine's, ``train.optimizer=lean``).

    A training check (``megaformer train`` before any process starts, and the engine), not
    one of :func:`load_config`'s: a config only read, not trained, may name any precision.
    """
    if train.precision in ("bf16", "fp16") and train.zero_stage == 0 and train.optimizer != "lean":
        raise ConfigError(
            f"train.precision={train.precision} keeps fp32 master weights in DeepSpeed's ZeRO optimizer: "
            f"set train.zero_stage=1 (with one data-parallel rank it shards nothing)"
        )


def _check_range(key: str, value: float, bounds: tuple[float | None, float | None, bool, bool], shown=None) -> None:
    """A finite value inside ``bounds``, or a ConfigError naming the key, the value as given (``shown``), the interval."""
    lo, hi, lo_open, hi_open = bounds
    value_as_given = value if shown is None else shown
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value_as_given}: must be a finite number")
    if (lo is not None and (value < lo or (lo_open and value == lo))) or (
        hi is not None and (value > hi or (hi_open and value == hi))
    ):
        raise ConfigError(f"{key}={value_as_given}: must be in {interval(lo, hi, lo_open, hi_open)}")


def validate(cfg: Config) -> None:
    """Checks that need no processes: choices, finiteness and value ranges. Layout checks live in parallel.layout."""
    for (section, name), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise ConfigError(f"{section}.{name}={value!r}: choose one of {', '.join(map(str, choices))}")
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            bounds = RANGES.get((section.name, f.name))
            if bounds is None:  # a numeric setting without a declared range is a bug of ours, not of the user
                raise AssertionError(f"config.RANGES has no entry for {section.name}.{f.name}")
            _check_range(f"{section.name}.{f.name}", value, bounds)
    _check_shapes(cfg)
    _check_pipeline(cfg)
    _check_sequence_padding(cfg.parallel)


def _check_sequence_padding(p: ParallelConfig) -> None:
    """Sequence parallelism pads lengths to a multiple of tp; exact masks need every layout to pad alike."""
    if p.sequence_parallel and p.tp > 1 and p.dropout_rng == "exact" and p.pad_to_multiple % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel at tp={p.tp} pads each batch's lengths to a multiple of {p.tp}, and the "
            f"dropout masks drawn at that shape would not be those of other layouts: set parallel.pad_to_multiple "
            f"to a multiple of {p.tp} (now {p.pad_to_multiple}; 8 suits GPUs), the same in every run that should "
            f"match this one, or parallel.dropout_rng=fast"
        )


MAX_WEIGHT = 2**40  # values in one weight: GPT-3's largest holds 6e8; past 2^63 bytes torch cannot even count them


def _check_shapes(cfg: Config) -> None:
    """No weight larger than :data:`MAX_WEIGHT` values (``info --set model.d_model=4000000000`` overflowed torch)."""
    m, d, v = cfg.model, cfg.model.d_model, cfg.data.vocab_size
    weights = [  # (the key to lower, its value, the weight, its values)
        ("model.d_model", d, f"the attention projection (3 x {d} x {d})", 3 * d * d),
        ("model.d_ff", m.d_ff, f"the feed-forward weight ({d} x {m.d_ff})", d * m.d_ff),
        ("data.vocab_size", v, f"the embedding ({v} x {d})", v * d),
        ("model.max_positions", m.max_positions, f"the position table ({m.max_positions} x {d})", m.max_positions * d),
    ]
    key, value, weight, size = max(weights, key=lambda w: w[3])
    if size > MAX_WEIGHT:
        raise ConfigError(
            f"{key}={value}: {weight} would hold {size:,} values, more than any model (2^40): lower {key}"
            + (" or model.d_model" if key != "model.d_model" else "")
        )


def stage_layer_counts(model: ModelConfig, pp: int, split: str = "") -> list[int] | None:
    """Layers per pipeline stage as ``parallel.pp_split`` gives them (None: to be cut by cost); checked against the model.

    The arithmetic of a pipeline layout, refused with what to change; the balanced cut
    itself is :func:`megaformer.parallel.stages.plan_stages`'s.
    """
    total = model.encoder_layers + model.decoder_layers
    if pp < 1:
        raise ConfigError(f"parallel.pp must be at least 1, got {pp}")
    if pp > total:
        raise ConfigError(
            f"parallel.pp={pp} is more than the model's {total} layers ({model.encoder_layers} encoder + "
            f"{model.decoder_layers} decoder): every stage needs a layer; use parallel.pp <= {total}"
        )
    return parse_split(split, pp, total) if split else None


def parse_split(text: str, pp: int, total: int) -> list[int]:
    """``"3,3,2"`` -> [3, 3, 2]: layers per stage, encoder layers first; checked against pp and the layer count."""
    try:
        counts = [int(x) for x in text.replace(" ", "").split(",")]
    except ValueError:
        raise ConfigError(
            f"parallel.pp_split={text!r}: expected comma-separated layer counts per stage, e.g. '3,3,2'"
        ) from None
    if len(counts) != pp:
        raise ConfigError(f"parallel.pp_split={text!r} names {len(counts)} stages but parallel.pp={pp}")
    if any(c < 1 for c in counts):
        raise ConfigError(f"parallel.pp_split={text!r}: every stage needs at least one layer")
    if sum(counts) != total:
        raise ConfigError(
            f"parallel.pp_split={text!r} sums to {sum(counts)} layers but the model has {total} "
            f"(encoder layers first, then decoder layers): make the counts sum to {total}"
        )
    return counts


def _check_pipeline(cfg: Config) -> None:
    """A pipeline layout the model cannot be cut into, or that the optimizer cannot run, is refused here."""
    stage_layer_counts(cfg.model, cfg.parallel.pp, cfg.parallel.pp_split)
    if cfg.parallel.pp > 1 and cfg.train.zero_stage > 1:
        raise ConfigError(
            f"train.zero_stage={cfg.train.zero_stage} with parallel.pp={cfg.parallel.pp}: ZeRO-2 frees each "
            f"micro-batch's gradients before the pipeline has summed the shared embedding's; use train.zero_stage=1"
        )
    if cfg.parallel.pp_split and cfg.parallel.pp == 1:
        raise ConfigError(f"parallel.pp_split={cfg.parallel.pp_split!r} needs parallel.pp > 1 (or leave it empty)")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(values: dict) -> Config:
    """Rebuild a config saved with :func:`to_dict` (e.g. from a checkpoint); validates it."""
    cfg = Config()
    _apply(cfg, values, "")
    validate(cfg)
    return cfg


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (into a run directory), whole or not at all: a rank stopped at start-up."""
    atomic_write_text(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))
