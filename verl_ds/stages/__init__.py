"""The supervised-style jobs of the pipeline on the RL job's config, engines, checkpoints and export:
``sft`` (``verl_ds.stages.sft``), and the reward-model and DPO jobs (``rm``, ``dpo``) on the same spine
(``verl_ds.stages.spine``: a stage is a ``StageJob`` subclass, exposed as its module's ``JOB`` and ``main``).
Run them with ``verl-ds sft|rm|dpo`` or ``launch/sft.py`` (``rm.py``, ``dpo.py``) under any launcher."""

STAGES = ("sft", "rm", "dpo")
