"""finetune: ZeRO-3 fine-tuning of HuggingFace causal LMs with DeepSpeed, built
around its checkpoints."""

__version__ = "0.1.0"
