"""What the process runs on and how it was launched: the device (CUDA, CPU, XLA),
the launcher's environment, rendezvous, SLURM, signals, rank-aware output and
the files it writes. Leaves: nothing here imports the rest of the project."""
