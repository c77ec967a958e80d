"""The pipeline's supervised-style jobs (``sft``, ``rm``, ``dpo``) on the RL job's config, engines, checkpoints and
export, each a ``StageJob`` (``verl_ds.stages.spine``) exposed as its module's ``JOB`` (docs/stages.md)."""

STAGES = ("sft", "rm", "dpo")
