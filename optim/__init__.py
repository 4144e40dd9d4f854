"""Outer optimizers (DiLoCo, SparseLoCo) over an `Exchange`; nothing here knows about sockets."""

from .diloco import DiLoCo, DiLoCoConfig
from .exchange import Exchange, InProcessExchange, InProcessHub, RoundFailed, RoundResult
from .outer import OuterOptimizer, PendingRound, copy_into_parameters, parameters_to_vector
from .schedule import warmup_cosine, warmup_cosine_scheduler
from .sparseloco import SparseLoCo, SparseLoCoConfig

__all__ = [
    "DiLoCo",
    "DiLoCoConfig",
    "Exchange",
    "InProcessExchange",
    "InProcessHub",
    "OuterOptimizer",
    "PendingRound",
    "copy_into_parameters",
    "parameters_to_vector",
    "RoundFailed",
    "RoundResult",
    "SparseLoCo",
    "SparseLoCoConfig",
    "warmup_cosine",
    "warmup_cosine_scheduler",
]
