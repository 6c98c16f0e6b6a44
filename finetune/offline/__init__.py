"""The offline tools: one plain process each, no launcher, no torch.distributed, no GPU.

``finetune export`` (export.py, lora_export.py, over the rank files read by zero_files.py),
``finetune verify`` (verify.py), and reading DeepSpeed's pickles without running code from them
(safe_load.py, which the online resume uses too).
"""
