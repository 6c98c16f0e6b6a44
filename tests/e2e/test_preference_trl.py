"""Each preference objective against TRL 1.16.0's own trainer (bench/train/trl_pref_run.py) on the
same untruncated pairs and the same saved tiny model: finetune on 2 ZeRO-3 ranks with gradient
accumulation 2 (a micro-batch of one pair), TRL in one process with the step's 4 pairs in one
batch. The first two steps' losses, gradient norms and TRL's metrics agree, so the losses, the
pairs' weighting across micro-batches and ranks, and the metrics are TRL's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.objectives import PAIR_METRICS

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "finetune" / "resources" / "data" / "preference_train.jsonl"
METRICS = PAIR_METRICS  # TRL's names
COMMON = (
    "--max_steps",
    "2",
    "--learning_rate",
    "1e-3",
    "--beta",
    "0.1",
)


def _trl(objective: str, model: Path, data: Path, out: Path) -> dict[int, dict]:
    result = out / "trl.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "train" / "trl_pref_run.py"),
        "--objective",
        objective,
        "--model_dir",
        str(model),
        "--tokenizer_dir",
        str(model),
        "--train_file",
        str(data),
        "--output_dir",
        str(out / "trl"),
        "--result",
        str(result),
        "--per_device_train_batch_size",
        "4",
        *COMMON,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    logs = json.loads(result.read_text())["logs"]
    return {row["step"]: row for row in logs if "loss" in row}


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
def test_the_first_steps_equal_trls_trainer(objective, run_finetune, tiny_models, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:8]))
    model = tiny_models["llama"]
    ours = run_finetune(
        "--objective",
        objective,
        "--model_name_or_path",
        str(model),
        "--train_file",
        str(data),
        "--validation_split_percentage",
        "0",
        "--per_device_train_batch_size",
        "1",
        "--gradient_accumulation_steps",
        "2",
        "--logging_steps",
        "1",
        "--lr_scheduler_type",
        "constant",
        "--warmup_steps",
        "0",
        "--dataset_cache_dir",
        str(tmp_path / "cache"),
        *COMMON,
    )
    assert ours.returncode == 0, ours.output[-3000:]
    rows = {r["step"]: r for r in ours.train_rows()}
    theirs = _trl(objective, model, data, tmp_path)
    keys = ("loss", "grad_norm", *METRICS) + (("nll_loss",) if objective == "orpo" else ())
    for key in keys:  # the tolerances: loss and metrics 1e-5, gradient norm 1e-4
        rel = 1e-4 if key == "grad_norm" else 1e-5
        assert rows[1][key] == pytest.approx(theirs[1][key], rel=rel, abs=1e-7), (
            key,
            rows[1][key],
            theirs[1][key],
        )
    # Step 2, after each tool's optimizer step (DeepSpeed's Adam, torch's AdamW): the loss and
    # log-probabilities (a reward is beta times a difference of two of them: it is compared
    # here to what that difference keeps of their precision).
    for key in ("loss", "logps/chosen", "logps/rejected"):
        assert rows[2][key] == pytest.approx(theirs[2][key], rel=1e-4), (key, rows[2], theirs[2])
    print(objective, {k: (rows[2][k], theirs[2][k]) for k in keys})
