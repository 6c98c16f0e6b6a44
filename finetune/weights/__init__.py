"""Procedures on a checkpoint's tensors that both the online component and the offline tools run.

The ZeRO-3 gather into HF safetensors shards (consolidate.py, collective) and the shard stream it
writes through (shards.py); reading ZeRO-3 rank files without DeepSpeed (zero_files.py); every
unpickling of a rank file (safe_load.py); DeepSpeed's universal conversion (universal.py); a LoRA
checkpoint's adapter files (adapter.py). Nothing here imports the Checkpointer or offline/.
"""
