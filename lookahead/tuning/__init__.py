"""Self-tuning steps: what a step costs on this machine (`cost`: measured, kept current, cached on disk) and how much
of its draft each step verifies for the most tokens per second (`budget`)."""

from .budget import BUCKET_SIZES, Choice, Fixed, StepBudget, bucket_choices, buckets
from .cost import KINDS, CostModel, Curve, fit, knots_up_to

__all__ = ["BUCKET_SIZES", "KINDS", "Choice", "CostModel", "Fixed", "Curve", "StepBudget", "bucket_choices", "buckets",
           "fit", "knots_up_to"]
