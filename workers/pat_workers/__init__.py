"""Data plane of PAT RLHF jobs: the adaptive-TP generation engine (and, later, the trainer)."""
