"""The one precision policy: autocast dtype, loss scaler, and the TF32/cuDNN flags, set and restored here.

fp32: exact float32 matmuls and convolutions; tf32: float32 tensors with TF32 matmuls and convolutions on
Ampere and later (the official DiT scripts' setting); bf16 and fp16: autocast around the DiT with float32
weights, fp16 with a loss scaler (CUDA only). Flags are process-wide in PyTorch, so ``flags()`` restores
what it found: a face that runs inside another program (a notebook, a test, the benchmark pairing two
precisions) leaves no trace.

Three kinds of network run in a training run, each with its own arithmetic: the DiT (``autocast``), the
frozen networks (the VAE's encode and REPA's encoder in the step, the VAE's decode of the grids and the
evaluations' images: ``frozen``, the run's precision, so a bf16 run does not spend most of its step or its
evaluation in IEEE float32), and the evaluation networks (``reference``: IEEE float32 whatever the run's
precision, as the reference evaluators compute, so scores stay comparable).
"""

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
    """A precision policy by name (one of ``PRECISIONS``: a face's ``--precision``, checked at its field, or a
    checkpoint's record of one); another name has no policy (KeyError)."""

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
        """The context for the frozen networks (VAE encode and decode, REPA's encoder, extraction): the run's
        autocast for bf16 and fp16; for fp32 and tf32 nothing, the flags already say IEEE or TF32."""
        return self.autocast()

    @contextmanager
    def flags(self, deterministic: bool = False):
        """TF32 on for tf32 only (so "fp32" means fp32 on every GPU generation); cuDNN determinism on request.

        Every backend's float32 mode is set, through the legacy matmul setting and the per-operator ones
        together: torch >= 2.9 raises on reading a legacy getter (``cuda.matmul.allow_tf32``,
        ``cudnn.allow_tf32``, ``get_float32_matmul_precision``, read by Inductor under compile) once the two
        APIs disagree (pytorch issue 166387), which setting only some operators left them doing."""
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
    """IEEE float32 with autocast off, whatever the run's precision: for the evaluation networks (Inception,
    the digit classifier), whose scores must stay comparable with the reference evaluators' float32."""
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
