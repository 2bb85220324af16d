"""train.py's configuration: the sections it composes (``TrainConfig`` checks what spans two), ``resolve`` that
builds it once, and ``resume_point`` that checks a resume against its record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dit.checkpoint import CheckpointSection
from dit.eval.inloop import EvalSamplingSection, EvalSection
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.io.face import Face, Values, plain
from dit.io.launcher import launcher_precision
from dit.model.config import DiTConfig, ModelSection
from dit.model.repa_config import RepaEncoderSection, RepaSection
from dit.objectives.section import ObjectiveSection
from dit.runtime import DeviceSection
from dit.train.data import DataSection
from dit.train.ledger import LedgerSection
from dit.train.optim import RECIPE_FIELDS as OPTIM_RECIPE
from dit.train.optim import OptimSection
from dit.train.parallel import ParallelSection
from dit.train.tokendrop import TokenDropSection

# What a resumed run must share with its checkpoint: the data order and the model's math (every model flag).
IDENTITY_FIELDS = (
    "seed",
    "global_batch_size",
    *ModelSection.names(),
    *ObjectiveSection.identity(),
    "repa_encoder",
    "repa_input_size",
    "repa_depth",
    "repa_projector_dim",
)
# What a resume may change only when --allow-changes names it: the optimizer's and objective's recipes, scaling.
RECIPE_FIELDS = (*OPTIM_RECIPE, *ObjectiveSection.RECIPE, *DataSection.RECIPE)
# What --allow-changes may name: the recipe, and the token-drop ratio and stages (the same tensors while above 0).
CHANGEABLE_FIELDS = (*RECIPE_FIELDS, "token_drop", "token_drop_until")


@dataclass(frozen=True)
class BudgetSection(Section):
    """How long the run trains."""

    max_steps: int = option(400_000, "optimizer steps to train for", ge=1)
    epochs: int | None = option(
        None, "the official train.py's length: epochs over the data, converted to --max-steps", ge=1
    )


@dataclass(frozen=True)
class TrainDeviceSection(DeviceSection):
    """The device section with training's default precision, bf16 (docs/performance.md)."""

    precision: str = option("bf16", DeviceSection.__dataclass_fields__["precision"].metadata["help"],
                            choices=DeviceSection.__dataclass_fields__["precision"].metadata["choices"])  # fmt: skip
    # torch's defaults (10 min NCCL, 30 gloo) can end a run while rank 0 gathers, hashes and writes a checkpoint
    dist_timeout_min: float = option(
        30.0, "minutes a process waits for the others in a collective (rank 0's checkpoint saves included)", gt=0
    )


@dataclass(frozen=True)
class TrainConfig:
    """Every section train.py reads; no component receives more than its own."""

    model: ModelSection = field(default_factory=ModelSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    budget: BudgetSection = field(default_factory=BudgetSection)
    runtime: TrainDeviceSection = field(default_factory=TrainDeviceSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    ledger: LedgerSection = field(default_factory=LedgerSection)
    eval: EvalSection = field(default_factory=EvalSection)
    eval_sampling: EvalSamplingSection = field(default_factory=EvalSamplingSection)
    repa_encoder: RepaEncoderSection = field(default_factory=RepaEncoderSection)
    repa: RepaSection = field(default_factory=RepaSection)
    token_drop: TokenDropSection = field(default_factory=TokenDropSection)

    def __post_init__(self):
        if self.model.learn_sigma and not self.objective.implementation.learns_sigma:
            raise FieldError(
                f"{{learn_sigma}} is for diffusion: a {self.objective.objective} model predicts one field "
                "(--no-learn-sigma)."
            )
        if unknown := sorted(set(self.checkpoint.allow_changes or ()) - set(CHANGEABLE_FIELDS)):
            raise FieldError(
                f"{{allow_changes}} {' '.join(unknown)}: only recipe fields may change on a resume "
                f"({', '.join(CHANGEABLE_FIELDS)}); the seed, the batch, the data and the model may not."
            )
        tracked = self.optim.ema_profiles or ()
        if self.eval.sigma_rel is not None and self.eval.sigma_rel not in tracked:
            raise FieldError(
                f"{{eval_sigma_rel}} {self.eval.sigma_rel:g} scores a tracked profile: pass one of {{ema_profiles}} "
                f"({' '.join(f'{s:g}' for s in tracked) or 'none set'}); `python -m dit.checkpoint ema` reconstructs others."
            )
        if self.token_drop.token_drop_until is not None and not self.model.token_drop:
            raise FieldError("{token_drop_until} ends token dropping: it needs {token_drop} R > 0.")
        if self.model.token_drop and self.repa_encoder.encoder:
            raise FieldError(
                "{token_drop} with REPA is not supported: REPA aligns every token of a block, the sparse blocks "
                "see only the kept ones. Pass one of them."
            )

    @classmethod
    def of(cls, **flat) -> TrainConfig:
        """From flat options (``max_steps=10, lr=1e-3``): what presets and flags set, for library callers."""
        return _compose(TRAIN_FACE.of(**flat))

    def replace(self, **flat) -> TrainConfig:
        """This config with flat options changed (``cfg.replace(max_steps=20)``)."""
        return TrainConfig.of(**{**TRAIN_FACE.flatten(self.record(), "the config"), **flat})

    def record(self) -> dict:
        """The configuration as plain data, nested by section: config.yaml and every checkpoint keep it."""
        return TRAIN_FACE.record(self.__dict__)

    def model_config(self, in_channels: int, input_size: int) -> DiTConfig:
        """The DiT this run trains, for data of ``in_channels`` x ``input_size`` x ``input_size``."""
        return self.model.dit_config(
            in_channels, input_size, learn_sigma=self.objective.implementation.learns_sigma
        )


# TrainConfig's sections whose flags carry a prefix (--eval-*, --repa-*); the others' are their field names.
_PREFIXES = {"eval": "eval_", "eval_sampling": "eval_", "repa_encoder": "repa_", "repa": "repa_"}
TRAIN_FACE = Face(
    "train.py",
    "Train a DiT: `torchrun --nproc_per_node=N train.py --model DiT-XL/2 --feature-path latents/` (or plain "
    "python).\n\nExit status: 0 finished, 128 + the signal's number when stopped by one (143 SIGTERM, 130 SIGINT, "
    "129 SIGHUP, 138 SIGUSR1; saved: rerun with --resume auto), 2 a user error (one line on stderr), 1 a bug.",
    sections={f.name: (f.default_factory, _PREFIXES.get(f.name, "")) for f in dataclasses.fields(TrainConfig)},
    renamed={"eval_sampling_steps": "eval_num_sampling_steps", "features_path": "feature_path"},
    outputs={"results_dir": "folder"},
    inputs={
        "data_path": "folder",
        "feature_path": "folder",
        "vae": "file",
        "init_from": "file",
        "eval_ref": "file",
        "eval_inception_weights": "file",
        "repa_encoder_weights": "file",
    },
)


def run_record(ckpt: dict) -> dict:
    """A checkpoint's run configuration as flat options in either layout, with what older records left implicit."""
    saved = ckpt.get("config") or {}
    flat = TRAIN_FACE.flatten(saved, "the checkpoint's record", strict=False) if isinstance(saved, dict) else {}
    if "vae" in flat and flat["vae"] is None:  # the flat layout recorded pixel space as None
        flat["vae"] = "none"
    if flat and "eval_labels" not in flat:  # a run recorded before the label modes evaluated with random labels
        flat["eval_labels"] = "random"
    return flat


def resolve(argv: list[str] | None = None) -> TrainConfig:
    """train.py's flags and preset (a resume's record, a store's VAE) as the run's ``TrainConfig``, built once."""
    v = TRAIN_FACE.values(argv)
    spell = TRAIN_FACE.speller(v)
    path = TRAIN_FACE.section("checkpoint", v.values, spell).resume_path()
    if path is not None:
        from dit.checkpoint import load_training_checkpoint

        saved = run_record(load_training_checkpoint(path, mmap=True))
        v = v.under({k: x for k, x in saved.items() if k not in CheckpointSection.START_ONLY})
    store = v.values["feature_path"]
    if store and isinstance(store, str):  # another type is the data section's error, below
        from dit.data.store import read_manifest

        manifest = read_manifest(store)
        found = {"image_size": manifest["image_size"], "num_classes": len(manifest["class_to_index"])}
        v = v.under({} if path else found)
        v = dataclasses.replace(v, values={**v.values, "vae": manifest["vae_id"]})  # the VAE its latents are of
    cfg = _compose(TRAIN_FACE.build(_launcher_precision(v).values, spell))
    if path is not None:
        resume_changes(TRAIN_FACE.flatten(cfg.record(), "the run"), saved, cfg.checkpoint, path)
    return cfg


def _launcher_precision(v: Values) -> Values:
    """accelerate's ``--mixed_precision`` decides the precision, unless ``--precision`` (or the preset) disagrees."""
    launcher = launcher_precision()
    if launcher is None or v.values["precision"] == launcher:
        return v
    if "precision" in v.given or "precision" in v.preset:
        raise UserError(
            f"accelerate launch asks for {launcher} (--mixed_precision) and this run for --precision "
            f"{v.values['precision']}: drop --mixed_precision or --precision (--precision alone decides under "
            "torchrun)."
        )
    return dataclasses.replace(v, values={**v.values, "precision": launcher})


def resume_point(cfg: TrainConfig, model_cfg: DiTConfig, record: dict):
    """(path, checkpoint, changed options) to continue from (checked against the record), or (None, None, [])."""
    from dit.checkpoint import latest_checkpoint, load_training_checkpoint
    from dit.model.config import describe

    start = cfg.checkpoint
    if not start.resume and latest_checkpoint(start.folder) is not None:
        raise UserError(
            f"{start.folder} already holds checkpoints: pass --resume auto to continue that run, "
            "or a new --results-dir; nothing was overwritten."
        )
    path = start.resume_path()  # None: a fresh run
    if path is None:
        return None, None, []
    ckpt = load_training_checkpoint(path)
    saved = DiTConfig(**ckpt["model_config"])
    if "token_drop" in (start.allow_changes or ()) and bool(saved.token_drop) == bool(model_cfg.token_drop):
        saved = dataclasses.replace(saved, token_drop=model_cfg.token_drop)  # same tensors, another ratio
    if saved != model_cfg:
        raise UserError(
            f"{path} was trained as {describe(saved)}, but this run builds {describe(model_cfg)}: pass the "
            "same --model, --image-size, --num-classes and data."
        )
    return path, ckpt, resume_changes(TRAIN_FACE.flatten(record, "the run"), run_record(ckpt), start, path)


# What a resume checks against its record: the model and data order, the recipe, and when token dropping ends.
GUARDED_FIELDS = (*IDENTITY_FIELDS, *RECIPE_FIELDS, "token_drop_until")


def resume_changes(mine: dict, saved: dict, start: CheckpointSection, path) -> list[str]:
    """The options that differ from the record, as '--flag new (recorded old)'; a guarded one is refused."""
    allowed = set(start.allow_changes or ())
    differ = [n for n in sorted(saved) if n in mine and plain(saved[n]) != plain(mine[n])]
    conflicts = [f"{n}: {saved[n]!r} -> {mine[n]!r}" for n in GUARDED_FIELDS if n in differ and n not in allowed]
    if "vae" in saved and latent_space(saved["vae"]) != latent_space(mine["vae"]):
        conflicts.append(f"vae (the latent space): {saved['vae']!r} -> {mine['vae']!r}")
    if conflicts:
        raise UserError(
            f"{path} was trained with other settings: {'; '.join(conflicts)}. A resume continues the same run: "
            "pass the checkpoint's values (recipe fields may change with --allow-changes NAME ...), or start a new "
            "run in another --results-dir. Nothing was written."
        )
    saved_profiles = {f"{s:g}" for s in saved.get("ema_profiles") or ()}
    added = sorted({f"{s:g}" for s in mine.get("ema_profiles") or ()} - saved_profiles)
    if added:  # with --allow-changes ema_profiles: a profile may be dropped, never added
        raise UserError(
            f"{path} tracks no post-hoc EMA profile {' '.join(added)}: a profile averages the run from its first "
            "step, so it cannot start on a resume. Resume with the checkpoint's --ema-profiles "
            f"({' '.join(sorted(saved_profiles)) or 'none'}), or start a new run. Nothing was written."
        )
    skip = {*GUARDED_FIELDS, *CheckpointSection.START_ONLY}
    return [f"{TRAIN_FACE.flag(n)} {mine[n]!r} (recorded {saved[n]!r})" for n in differ if n not in skip]


def latent_space(vae_spec: str | None) -> str | None:
    """The SD VAEs share one latent space; another VAE is its own; pixel space (None, "none") is None."""
    from dit.cost.vae_facts import is_sd_vae

    if vae_spec in (None, "none"):
        return None
    return "sd" if is_sd_vae(vae_spec) else vae_spec


def _compose(sections: dict) -> TrainConfig:
    try:
        return TrainConfig(**sections)
    except FieldError as e:
        raise UserError(e.spelled(TRAIN_FACE.spelled)) from None
