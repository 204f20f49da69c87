"""Self-tuning steps: what a step costs on this machine (`curve`: measured, kept current; `cost`: a curve per kind of
step, cached on disk) and how much of its draft each step verifies for the most tokens per second (`budget`)."""

from .budget import BUCKET_SIZES, Choice, Fixed, StepBudget, bucket_choices, buckets
from .cost import KINDS, CostModel
from .curve import Curve, fit, knots_up_to

__all__ = ["BUCKET_SIZES", "KINDS", "Choice", "CostModel", "Curve", "Fixed", "StepBudget", "bucket_choices", "buckets",
           "fit", "knots_up_to"]
