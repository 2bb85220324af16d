"""What a run trains the DiT to do, behind one interface (``Objective``): DiT's Gaussian diffusion or SiT's flow
matching (``OBJECTIVES``). Nothing outside this package asks which one it is."""

from dit.objectives.diffusion import DiffusionObjective
from dit.objectives.flow import FlowObjective
from dit.objectives.objective import Objective
from dit.objectives.registry import OBJECTIVES, from_record, objective_for_sampler, of_sampling_fields

__all__ = [
    "OBJECTIVES", "DiffusionObjective", "FlowObjective", "Objective", "from_record", "objective_for_sampler",
    "of_sampling_fields",
]  # fmt: skip
