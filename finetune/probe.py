"""Test seam: the training model's logits on a fixed input, for comparing an exported model with it.

``FINETUNE_PROBE_LOGITS=<file>``: after the final evaluation every rank runs the model (a collective
forward under ZeRO-3) on the same token ids, and rank 0 saves the logits to ``<file>`` (torch.save,
fp32, CPU). tests/distributed/test_lora_runs.py holds the adapter and merged exports to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from finetune import distributed as dist
from finetune.io import seams

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase


def probe_input(vocab_size: int) -> torch.Tensor:
    """Two rows of 24 token ids, the same for every caller."""
    return (torch.arange(48, dtype=torch.long) * 7 % vocab_size).reshape(2, 24)


@torch.no_grad()
def maybe_probe(engine: DeepSpeedEngine, tokenizer: PreTrainedTokenizerBase) -> None:
    """Every rank, when the seam is set (an environment every rank shares). Collective."""
    path = seams.value(seams.PROBE_LOGITS)
    if not path:
        return
    engine.eval()
    logits = engine(input_ids=probe_input(len(tokenizer)).to(engine.device)).logits
    # Agreed: a failed write on rank 0 must not leave the others in the final save's collectives.
    dist.run_agreed(lambda: torch.save(logits.float().cpu(), path), on=dist.is_main())
    engine.train()
