"""Lookahead parallelism (the paper's §3.4): one generation divided among the processes of a `torch.distributed`
group (`driver.py`), each rank's share of a step (`substep.py`) and the one message per rank and step
(`exchange.py`)."""

from .driver import ParallelStepModel, agree, decode_parallel, sub_step_patterns

__all__ = ["ParallelStepModel", "agree", "decode_parallel", "sub_step_patterns"]
