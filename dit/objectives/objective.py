"""The one interface a training objective implements; its class attributes need no torch (``dit-cost``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from dit.io.errors import UserError


class Objective(ABC):
    """A training objective and how its samples are drawn."""

    name: ClassVar[str]
    samplers: ClassVar[tuple[str, ...]]  # the sampler names (dit.objectives.samplers' registry) that sample it
    default_sampler: ClassVar[str]  # sample.py's default
    fast_sampler: ClassVar[str]  # the training grid's and the in-loop evaluation's default
    learns_sigma: ClassVar[bool]  # whether the model may output a variance too (DiT's default for diffusion)
    noun: ClassVar[str]  # how messages name its models: "a {noun} model"

    @classmethod
    @abstractmethod
    def from_record(cls, run: dict, learn_sigma: bool) -> Objective:
        """From a run's options (an ObjectiveSection's fields, or a checkpoint's record of them)."""

    @abstractmethod
    def sampling_fields(self) -> dict:
        """The fields of ``dit.sample.SamplingModel`` that record this objective."""

    @abstractmethod
    def task(self) -> dict:
        """What the output means: two models whose tasks are equal can guide one another (autoguidance)."""

    @abstractmethod
    def sample_t(self, n: int, generator, device):
        """Training times of a batch of ``n``, drawn from ``generator`` on ``device``."""

    @abstractmethod
    def training_losses(self, model_fn, x, t, model_kwargs=None, noise=None) -> dict:
        """Per-sample losses ({"loss": (N,), ...}) of ``model_fn`` on data ``x`` at times ``t``."""

    def tables(self, device) -> Objective:
        """Upload what the step reads to ``device`` once, so that a step makes no host-to-device copy."""
        return self

    def model_outputs(self, in_channels: int, learn_sigma: bool) -> int:
        """The channels the model must output for inputs of ``in_channels``."""
        return in_channels * (2 if learn_sigma and self.learns_sigma else 1)

    def sampling_interval(self, sample_eps: float | None) -> tuple[float, float]:
        """[t0, t1] of a sampler's time grid (the flow's; a diffusion's respacing has none)."""
        return 0.0, 1.0

    @classmethod
    def sampler(cls, kind: str | None, fast: bool = False) -> str:
        """The sampler ``kind`` (None: the default, or the fast one); one that does not sample it is refused."""
        kind = kind or (cls.fast_sampler if fast else cls.default_sampler)
        if kind not in cls.samplers:
            raise UserError(
                f"--sampler {kind} does not sample a {cls.noun} model: pick from its samplers, "
                f"{', '.join(cls.samplers)}."
            )
        return kind

    @abstractmethod
    def check_options(self, kind: str, method: str | None, sample_eps: float | None, diffusion_form: str) -> None:
        """The checks of a sampler's options that depend on the objective (``UserError`` if one does not apply)."""

    @property
    @abstractmethod
    def time_shift(self) -> float:
        """The timestep shift its training drew with (a number): its samplers' default."""

    @abstractmethod
    def process(self, num_steps: int, sample_eps: float | None, time_shift: float | None = None):
        """What a ``num_steps`` sampler integrates: a respaced (shifted) diffusion, or the transport."""

    @abstractmethod
    def sampling_loop(self, kind: str, process, plan, *, method: str | None, diffusion_form: str, last_step: str,
                      atol: float, rtol: float) -> Callable:  # fmt: skip
        """Sampler ``kind``'s ``loop(model_fn, x, model_kwargs, noise, progress) -> x`` over ``process`` along
        ``plan``, made before the first batch (what it needs installed is asked for then)."""

    @abstractmethod
    def noise_to_signal(self) -> tuple:
        """(times, sigma / alpha) as numpy arrays, the times in ``--guidance-interval``'s units."""

    @abstractmethod
    def manifest(self, sample_eps: float | None) -> dict | None:
        """What a sample set's manifest records of the objective."""
