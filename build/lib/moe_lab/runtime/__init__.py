"""The run-time layer: what every task runs on. Atomic writes, checkpoint I/O and resume, the run lock,
signals, preflight and plan, strategies, precision, SLURM and the Trainer."""
