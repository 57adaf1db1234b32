"""Evaluation config: `eval @ eval.toml` (offline) and `[orchestrator.eval]` (online, every N steps in `rl`).

An evaluation draws `num_examples` tasks per environment from its own seed (a split held out from
training by construction: the training tasks come from the orchestrator's seed; the same eval tasks
every time, so evaluations along a run are comparable), samples `rollouts_per_example` rollouts of each
and reports the mean reward and pass@k (unbiased estimator, a rollout passes when its reward is >=
`pass_threshold`) for k = 1, 2, 4, ... up to `rollouts_per_example`.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from prime_rl.common.config.orchestrator import ClientModelConfig, EvalSetConfig
from prime_rl.common.config.run_section import RunSectionConfig


class EvalConfig(EvalSetConfig, RunSectionConfig):
    """`eval @ eval.toml`: evaluate the model an inference server serves (a base model or a checkpoint)."""

    run_name: str = "eval"
    """Results go to <output_dir>/<run_name>/: evals/step_<step>/<env>/samples.jsonl and metrics.jsonl."""
    model: ClientModelConfig = ClientModelConfig()
    """The served model (start `inference` on the checkpoint to evaluate, then point model.client at it)."""
    step: int = Field(default=0, ge=0)
    """Step the results are logged under (e.g. the checkpoint's step)."""
    seq_len: int = Field(default=2048, ge=2)
    """Most tokens of one rollout (prompt and every turn)."""
    max_concurrent: int = Field(default=32, ge=1)
    """Tasks in flight at once."""

    @model_validator(mode="after")
    def _needs_env(self) -> EvalConfig:
        if not self.env:
            raise ValueError('eval needs at least one environment: add [[env]] with type = "..." to eval.toml')
        return self
