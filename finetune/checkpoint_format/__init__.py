"""The checkpoint's format, below everything that reads or writes checkpoints.

What a checkpoint is on disk and in a bucket, and the decisions that follow from it, with no
process group, engine or background work: OUT's layout over a Storage (outdir.py), the manifest and
its verification (manifest.py), tags and commit order and the retention policy as pure functions of
manifests (policy.py), the state files (state.py: trainer_state.json, each rank's RNG) and the best
checkpoint's records and rules (best.py). The online component (checkpoint/), the bucket (remote/),
the shared procedures (weights/) and the offline tools (offline/, listing, plot) all import it.
"""
