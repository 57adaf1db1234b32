"""vf-arithmetic: a verifiers (v1) taskset; `load_environment` finds it by its id, `vf-arithmetic`."""

from vf_arithmetic.taskset import ArithmeticTaskset

__all__ = ["ArithmeticTaskset"]
