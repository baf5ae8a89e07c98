"""Adaptive tensor-parallel generation engine.

model (weights as views) <- engine (continuous batching, one TP group) <- regroup (layout changes in place)
<- rank (one process per device) <- generator (the pod's ranks driven from one process).

The public surface is what a coordinator needs; everything else is internal.
"""

from .engine import Request
from .generator import GeneratorError, LocalGenerator, RunResult
from .rank import EngineOptions
from .regroup import RegroupReport
from .sampling import SamplingParams
from .tiny import make_tiny_model

__all__ = ["EngineOptions", "GeneratorError", "LocalGenerator", "RegroupReport", "Request", "RunResult",
           "SamplingParams", "make_tiny_model"]
