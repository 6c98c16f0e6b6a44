"""Checkpoints: crash-safe partitioned/consolidated saves, manifest, training state, resume."""
