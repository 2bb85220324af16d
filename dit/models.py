"""The official ``models.py`` names, for ``from models import DiT_models`` drop-ins: the model is ``dit.model``."""

from dit.model.dit import DiT, DiT_models  # noqa: F401
