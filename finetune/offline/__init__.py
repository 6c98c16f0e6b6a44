"""The offline tools: one plain process each, no launcher, no torch.distributed, no GPU.

``finetune export`` (export.py, lora_export.py, model_files.py) and ``finetune verify``
(verify.py). What they share with the online component lives below them: the checkpoint's format
(checkpoint_format/), the procedures on its tensors (weights/) and the bucket's fetch and verify
(remote/).
"""
