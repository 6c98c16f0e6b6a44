"""Preference pairs: a prompt, a chosen and a rejected completion (TRL's preference formats), for a
preference --objective.

Two forms, as TRL's DPOTrainer reads them:
  text            ``prompt``, chosen and rejected strings; eos is appended to each completion's
                  text (unless it ends with it), and prompt + completion are tokenized together
  conversational  chosen and rejected lists of messages, with a ``prompt`` list of messages or
                  without one (then the prompt is the messages the two share at their start);
                  rendered by the tokenizer's chat template, the prompt with its generation
                  prompt

The completion starts where the tokenized prompt and the tokenized prompt + completion part (as
TRL's ``common_prefix_length``), so a token merged across the boundary is the completion's. Each
encoded pair is three int32 columns: ``prompt_ids``, ``chosen_ids``, ``rejected_ids``; a prompt
keeps its last --max_prompt_length tokens, then prompt + completion their first --max_seq_length
(TRL's keep_start). A pair left with an empty completion, or with equal completions, is dropped
(and counted with the run's other dropped examples).

``collate_pairs`` makes a micro-batch of B pairs into one forward of 2B rows (chosen rows, then
rejected rows), so ZeRO-3 gathers each layer once per pair.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from finetune.config import ConfigError
from finetune.data.formats import IGNORE, Format, messages, register

PROMPT = "prompt"  # TRL's name for the prompt column


@register
class Preference(Format):
    """A preference objective's pairs."""

    name = "preference"
    flags = ("chosen_column", "rejected_column", "max_prompt_length")
    selected_by = "chosen_column"
    together = ()  # each column has its default; --max_prompt_length is optional
    empty_rows = "pairs left with an empty completion, or with chosen equal to rejected"
    features = ("prompt_ids", "chosen_ids", "rejected_ids")
    pairs: ClassVar[bool] = True

    @property
    def columns(self) -> dict[str, str]:
        return {flag: self.values[flag] for flag in ("chosen_column", "rejected_column")}

    def check(self, ds) -> None:
        if len(ds):
            row = ds[0]
            chosen = self.values["chosen_column"]
            if _conversational(row[chosen]):
                messages(row[chosen], chosen, "chosen_column")
            elif PROMPT not in ds.column_names:
                raise ConfigError(
                    f"--chosen_column: text pairs need a '{PROMPT}' column beside '{chosen}' "
                    f"(available: {', '.join(ds.column_names)})"
                )

    def encode(self, batch: dict[str, list], tokenizer, max_len: int) -> list[dict[str, list[int]]]:
        chosen_col, rejected_col = self.values["chosen_column"], self.values["rejected_column"]
        chosen, rejected = batch[chosen_col], batch[rejected_col]
        prompts = batch.get(PROMPT) or [None] * len(chosen)
        if chosen and _conversational(chosen[0]):
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError(
                    f"--{chosen_col}: pairs of messages need a tokenizer with a chat template "
                    "(pass --tokenizer_name with one)"
                )
            texts = [
                _render(
                    tokenizer,
                    p,
                    messages(c, chosen_col, "chosen_column"),
                    messages(r, rejected_col, "rejected_column"),
                )
                for p, c, r in zip(prompts, chosen, rejected, strict=True)
            ]
            prompt_t, chosen_t, rejected_t = (list(t) for t in zip(*texts, strict=True))
            special = False  # the template writes the special tokens
        else:
            eos = tokenizer.eos_token or ""
            prompt_t = [str(p or "") for p in prompts]
            chosen_t = [p + _ending(str(c or ""), eos) for p, c in zip(prompt_t, chosen)]
            rejected_t = [p + _ending(str(r or ""), eos) for p, r in zip(prompt_t, rejected)]
            special = True
        ids = [
            tokenizer(texts, add_special_tokens=special)["input_ids"]
            for texts in (prompt_t, chosen_t, rejected_t)
        ]
        limit = self.values["max_prompt_length"]
        return [_pair(p, c, r, max_len, limit) for p, c, r in zip(*ids, strict=True)]

    def keeps(self, row: dict[str, list[int]]) -> bool:
        """Both completions scored (a token after the row's first: the model shifts labels) and
        not equal."""
        first = 0 if row["prompt_ids"] else 1  # without a prompt, the first token is not scored
        scored = all(len(row[side]) > first for side in ("chosen_ids", "rejected_ids"))
        return scored and row["chosen_ids"] != row["rejected_ids"]


def _ending(text: str, eos: str) -> str:
    return text if not eos or text.endswith(eos) else text + eos


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _pair(
    prompt: list[int], chosen: list[int], rejected: list[int], max_len: int, limit: int | None
) -> dict[str, list[int]]:
    """Split at the prompt's end as tokenized with each completion, then truncate."""
    n = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    p, c, r = prompt[:n], chosen[n:], rejected[n:]
    if limit is not None:
        p = p[-limit:]
    room = max(max_len - len(p), 0)
    return {"prompt_ids": p, "chosen_ids": c[:room], "rejected_ids": r[:room]}


# --- the conversational form ------------------------------------------------------------------


def _conversational(value: Any) -> bool:
    """A list of messages (or its JSON text, as CSV and some exports carry it), not plain text."""
    if isinstance(value, str):
        if not value.lstrip().startswith("["):
            return False
        try:
            value = json.loads(value)
        except ValueError:
            return False  # text that happens to start with a bracket
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _render(tokenizer, prompt: Any, chosen: list[dict], rejected: list[dict]) -> tuple[str, ...]:
    """(prompt, prompt + chosen, prompt + rejected) as the chat template renders them. Without a
    prompt, the messages chosen and rejected share at their start are the prompt (TRL's
    ``extract_prompt``)."""
    if prompt is None:
        n = _common_prefix(chosen, rejected)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        prompt = messages(prompt, PROMPT, None)

    def render(msgs: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    return render(prompt, True), render(prompt + chosen, False), render(prompt + rejected, False)


# --- batches ----------------------------------------------------------------------------------


def collate_pairs(rows: list[dict], pad_id: int) -> dict:
    """B pairs → one micro-batch of 2B rows, chosen then rejected, right-padded: ``input_ids``,
    ``attention_mask``, ``labels`` (the completion's tokens; the prompt and padding IGNORE), the
    reference's log-probabilities where the rows carry them (``ref_chosen``, ``ref_rejected``),
    and the counts (NUM_TOKENS: real tokens of both rows; NUM_ROWS: pairs)."""
    import torch

    from finetune.data.load import NUM_ROWS, NUM_TOKENS

    seqs = [(r["prompt_ids"], r["chosen_ids"]) for r in rows]
    seqs += [(r["prompt_ids"], r["rejected_ids"]) for r in rows]
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(list(p) + list(c))
        labels[i, len(p) : n] = torch.tensor(list(c))
        mask[i, :n] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if "ref_chosen" in rows[0]:
        for key in ("ref_chosen", "ref_rejected"):
            batch[key] = torch.tensor([r[key] for r in rows], dtype=torch.float64)
    return batch | {NUM_TOKENS: mask.sum(), NUM_ROWS: torch.tensor(len(rows))}
