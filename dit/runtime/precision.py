"""The one precision policy: autocast dtype, loss scaler, and the TF32/cuDNN flags, set and restored here.

fp32: exact float32 matmuls and convolutions; tf32: float32 tensors with TF32 matmuls and convolutions on
Ampere and later (the official DiT scripts' setting); bf16 and fp16: autocast around the DiT with float32
weights, fp16 with a loss scaler (CUDA only). Flags are process-wide in PyTorch, so ``flags()`` restores
what it found: a face that runs inside another program (a notebook, a test, the benchmark pairing two
precisions) leaves no trace.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from dit.errors import UserError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Precision:
    name: str = "fp32"
    device_type: str = "cpu"

    def __post_init__(self):
        if self.name not in PRECISIONS:
            raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.name!r}.")
        if self.name == "fp16" and self.device_type != "cuda":
            # autocast would run fp16 on the CPU at a fraction of the speed, and GradScaler needs CUDA.
            raise UserError(
                "fp16 needs a CUDA device (it runs fp32 on CPU without a word): use --precision bf16 or fp32."
            )

    @property
    def amp_dtype(self) -> torch.dtype | None:
        """The autocast dtype, None where the model runs in float32."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

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

    @contextmanager
    def flags(self, deterministic: bool = False):
        """TF32 on for tf32 only (so "fp32" means fp32 on every GPU generation); cuDNN determinism on request."""
        matmul, conv, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn
        saved = matmul.fp32_precision, conv.fp32_precision, cudnn.deterministic
        matmul.fp32_precision = conv.fp32_precision = "tf32" if self.name == "tf32" else "ieee"
        cudnn.deterministic = deterministic or saved[2]
        try:
            yield self
        finally:
            matmul.fp32_precision, conv.fp32_precision, cudnn.deterministic = saved
