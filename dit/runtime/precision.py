"""The one precision policy: autocast dtype, loss scaler, and the TF32/cuDNN flags, set and restored here
(the flags are process-wide, so ``flags()`` restores what it found). fp32 is exact float32, tf32 float32 with
TF32 matmuls (the official DiT scripts'), bf16 and fp16 autocast (fp16 with a loss scaler, CUDA only). The DiT
runs in ``autocast``, the frozen networks in ``frozen`` (the run's precision), the evaluation networks in
``reference`` (IEEE float32, so scores stay comparable): docs/performance.md."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from dit.io.errors import UserError

# Each precision's autocast dtype (None: the model runs in float32); its keys are the --precision choices.
AUTOCAST_DTYPES = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(AUTOCAST_DTYPES)


@dataclass(frozen=True)
class Precision:
    """A precision policy by name, one of ``PRECISIONS`` (another name: KeyError)."""

    name: str = "fp32"
    device_type: str = "cpu"
    amp_dtype: torch.dtype | None = field(init=False, repr=False, compare=False)  # the autocast dtype

    def __post_init__(self):
        object.__setattr__(self, "amp_dtype", AUTOCAST_DTYPES[self.name])
        if self.name == "fp16" and self.device_type != "cuda":
            # autocast would run fp16 on the CPU at a fraction of the speed, and GradScaler needs CUDA.
            raise UserError(
                "fp16 needs a CUDA device (it runs fp32 on CPU without a word): use --precision bf16 or fp32."
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.amp_dtype or torch.float32

    def autocast(self):
        """The context to run the DiT in (a no-op for fp32 and tf32)."""
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler("cuda") if self.name == "fp16" else None

    def frozen(self):
        """The context for the frozen networks (VAE, REPA's encoder): the run's autocast."""
        return self.autocast()

    @contextmanager
    def flags(self, deterministic: bool = False):
        """TF32 on for tf32 only (so "fp32" means fp32 on every GPU); cuDNN determinism on request. The legacy
        and per-operator settings move together: torch >= 2.9 raises on a legacy getter once they disagree
        (pytorch issue 166387)."""
        mode = "tf32" if self.name == "tf32" else "ieee"
        cudnn = torch.backends.cudnn
        saved = _read(torch.get_float32_matmul_precision), _read(lambda: cudnn.allow_tf32)
        saved_ops, saved_deterministic = [op.fp32_precision for op in _FP32_OPS], cudnn.deterministic
        _set_legacy("high" if mode == "tf32" else "highest", mode == "tf32")  # first: they reset some operators
        for op in _FP32_OPS:
            op.fp32_precision = mode
        cudnn.deterministic = deterministic or saved_deterministic
        try:
            yield self
        finally:
            _set_legacy(*saved)
            for op, value in zip(_FP32_OPS, saved_ops):
                op.fp32_precision = value
            cudnn.deterministic = saved_deterministic


# Every operator with a float32 mode of its own (matmul, convolution, recurrent) on CUDA/cuDNN and oneDNN.
_B = torch.backends
_FP32_OPS = (_B.cuda.matmul, _B.cudnn.conv, _B.cudnn.rnn, _B.mkldnn.matmul, _B.mkldnn.conv, _B.mkldnn.rnn)


@contextmanager
def reference(device_type: str):
    """IEEE float32 with autocast off, whatever the run's precision: for the evaluation networks."""
    with Precision("fp32").flags(), torch.autocast(device_type, enabled=False):
        yield


def _set_legacy(matmul: str | None, cudnn: bool | None) -> None:
    """The legacy settings (each also resets the per-operator modes it covers); None leaves one as it is."""
    if matmul is not None:
        torch.set_float32_matmul_precision(matmul)
    if cudnn is not None:
        torch.backends.cudnn.allow_tf32 = cudnn


def _read(getter):
    """A legacy getter's value, or None where the caller's own settings already disagree (it raises then)."""
    try:
        return getter()
    except RuntimeError:
        return None
