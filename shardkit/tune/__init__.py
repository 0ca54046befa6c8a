"""`shardkit tune`: hyperparameter search over real trainer runs.

space (the `--space` grammar), runner (one trainer subprocess, followed as it writes its metrics),
storage (Optuna's RDB storage and recovery of interrupted trials), study (samplers, pruners, the
ask / run / tell loop), pbt (population-based training over the trainer's checkpoints, shared by the
tuners of one study), pbt_plan (its decisions, pure functions), pbt_checkpoints (the members' shared
checkpoint root), report and plots (what people look at). The tuner drives the trainer; nothing imports the tuner but the CLI.
"""
