"""The best checkpoint and early stopping (checkpoint_format/best.py): the comparison, the
counters, the manifest fields, and retention keeping the best (a real Checkpointer on a fake
engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from checkpoint.fake_engine import (  # noqa: F401
    _fake_engines_model_is_not_checked,
    make_cfg,
    make_manager,
    tiny_module,
)

from finetune.checkpoint_format import best
from finetune.checkpoint_format.best import BestPolicy
from finetune.checkpoint_format.manifest import read_manifest
from finetune.checkpoint_format.outdir import OutputDir
from finetune.checkpoint_format.policy import Committed, select_for_deletion
from finetune.checkpoint_format.state import TrainingState


def row(step: int, loss: float) -> dict:
    return {"step": step, "eval_loss": loss, "eval_perplexity": 2.0**loss, "eval_tokens": 10}


# --- the comparison ------------------------------------------------------------------------------


def test_metric_names_and_direction_follow_hf():
    assert best.metric_name(None) == best.metric_name("loss") == "eval_loss"
    assert best.metric_name("perplexity") == best.metric_name("eval_perplexity")
    args = SimpleNamespace(
        metric_for_best_model="loss",
        greater_is_better=None,
        early_stopping_patience=None,
        early_stopping_threshold=0.0,
    )
    assert BestPolicy.from_args(args) == BestPolicy("eval_loss", False, None, 0.0)
    args.greater_is_better = True
    assert BestPolicy.from_args(args).greater_is_better
    assert best.lower_is_better("eval_perplexity") and not best.lower_is_better("eval_accuracy")


def test_better_and_improved_with_threshold_and_direction():
    lower = BestPolicy(threshold=0.1)
    assert lower.better(1.0, None) and lower.improved(1.0, None)
    assert lower.better(0.95, 1.0) and not lower.improved(0.95, 1.0)  # within the threshold
    assert lower.improved(0.85, 1.0)
    assert not lower.better(1.0, 1.0)  # equal is not better (the earlier best stays)
    assert not lower.better(1.2, 1.0) and not lower.improved(1.2, 1.0)
    higher = BestPolicy("eval_perplexity", greater_is_better=True, threshold=0.0)
    assert higher.better(2.0, 1.0) and higher.improved(2.0, 1.0) and not higher.better(0.5, 1.0)
    assert not lower.better(None, 1.0)
    assert lower.value({"eval_loss": float("nan")}) is None  # never the best


def test_early_stopping_counts_evaluations_without_improvement():
    policy, state = BestPolicy(patience=2, threshold=0.05), TrainingState()
    for step, loss, count in [(0, 3.0, 0), (4, 2.0, 0), (8, 1.97, 1), (12, 1.5, 0), (16, 1.6, 1)]:
        best.record(state, policy, row(step, loss))
        assert state.evals_without_improvement == count, step
        assert not best.exhausted(state, policy)
    # 1.97 beat 2.0 (a new best) without beating it by the threshold: HF's rule, both
    assert (state.best_metric, state.best_metric_step) == (1.5, 12)
    best.record(state, policy, row(20, 1.49))
    assert best.exhausted(state, policy) and state.best_metric == 1.49
    assert not best.exhausted(state, BestPolicy())  # no patience: never


def test_state_without_the_counters_still_loads():
    sd = TrainingState(global_step=5).state_dict()
    for key in ("best_metric", "best_metric_step", "evals_without_improvement"):
        sd.pop(key)
    state = TrainingState.from_state_dict(sd)
    assert (state.global_step, state.best_metric, state.evals_without_improvement) == (5, None, 0)


# --- the best checkpoint's record ----------------------------------------------------------------


def test_best_of_a_line_and_after_each_commit():
    policy = BestPolicy()
    line = [("global_step2", row(2, 2.0)), ("global_step3", None), ("global_step4", row(4, 1.0))]
    assert best.best_of_line(policy, line)["tag"] == "global_step4"
    assert best.best_of_line(policy, [("global_step3", None)]) is None
    record = best.best_of_line(policy, line)
    assert best.after_commit(policy, record, "global_step6", row(6, 1.5)) == record
    assert best.after_commit(policy, record, "global_step6", None) == record
    assert best.after_commit(policy, record, "global_step6", row(6, 0.5))["value"] == 0.5
    assert best.eval_at(row(6, 1.0), 6) == row(6, 1.0) and best.eval_at(row(6, 1.0), 7) is None


def test_the_newest_commit_names_the_best():
    manifests = {
        "global_step2": {"commit_seq": 1, "best": {"tag": "global_step2", "value": 1.0}},
        "global_step4": {"commit_seq": 2, "best": {"tag": "global_step2", "value": 1.0}},
        "global_step6": None,  # never committed
    }
    assert best.named_best(manifests)["tag"] == "global_step2"
    assert best.named_best({"global_step4": manifests["global_step4"]}) is None  # gone
    assert best.named_best({"global_step4": {"commit_seq": 2}}) is None  # not evaluated


def test_retention_keeps_the_best_besides_the_limit():
    line = ["global_step2", "global_step4", "global_step6", "global_step8"]
    assert select_for_deletion(line, 1, {"global_step8"}, best="global_step2") == [
        "global_step4",
        "global_step6",
    ]
    assert select_for_deletion(line, 2, {"global_step8"}, best="global_step4") == ["global_step2"]
    # the best among the newest counts as one of them
    assert select_for_deletion(line, 1, {"global_step8"}, best="global_step8") == line[:3]
    assert select_for_deletion(line, 2, {"global_step8"}) == line[:2]


def test_committed_reads_eval_and_best_from_a_manifest():
    c = Committed.from_manifest(
        "global_step4", {"commit_seq": 3, "eval": row(4, 1.0), "best": {"tag": "global_step2"}}
    )
    assert (c.eval, c.best) == (row(4, 1.0), "global_step2")
    assert hash(c) is not None  # still usable in sets
    assert Committed.from_manifest("global_step4", {"best": "junk"}).best is None


# --- a real Checkpointer (fake engine) -----------------------------------------------------------


def save(manager, progress, step, loss=None):
    progress.global_step = step
    manager.evaluated = row(step, loss) if loss is not None else None
    manager.save(step)


def test_the_best_checkpoint_survives_save_total_limit_and_a_restart(tmp_path, tiny_module):  # noqa: F811
    cfg = make_cfg(tmp_path, save_total_limit=1, eval_steps=2, save_steps=2)
    m, progress, _ = make_manager(cfg, tiny_module, best=BestPolicy())
    save(m, progress, 2, 3.0)
    save(m, progress, 4, 1.0)  # the best
    save(m, progress, 6, 2.0)
    save(m, progress, 7)  # no evaluation at this step: no metric, never the best
    assert OutputDir(tmp_path).tags() == ["global_step4", "global_step7"]
    seven = read_manifest(tmp_path / "global_step7")
    assert "eval" not in seven and seven["best"]["tag"] == "global_step4"
    four = read_manifest(tmp_path / "global_step4")
    assert four["eval"] == row(4, 1.0)
    assert four["best"] == {
        "tag": "global_step4",
        "metric": "eval_loss",
        "value": 1.0,
        "greater_is_better": False,
    }
    # A resumed run finds the best in its line's manifests (read once at start) and keeps it.
    cfg = make_cfg(
        tmp_path, save_total_limit=1, eval_steps=2, save_steps=2, resume_from_checkpoint="auto"
    )
    m, progress, plan = make_manager(cfg, tiny_module, run_id="run2", best=BestPolicy())
    assert m.lineage.best["tag"] == "global_step4"
    save(m, progress, 8, 1.5)
    assert OutputDir(tmp_path).tags() == ["global_step4", "global_step8"]
    save(m, progress, 10, 0.5)  # a new best: the old one goes like any other
    assert OutputDir(tmp_path).tags() == ["global_step10"]
    assert read_manifest(tmp_path / "global_step10")["best"]["tag"] == "global_step10"


def test_an_async_save_records_the_eval_of_its_own_step(tmp_path, tiny_module):  # noqa: F811
    cfg = make_cfg(tmp_path, eval_steps=2, save_steps=2, async_save=True)
    m, progress, _ = make_manager(cfg, tiny_module, best=BestPolicy())
    progress.global_step = 2
    m.evaluated = row(2, 1.0)
    m.save(2, background=True)
    m.evaluated = row(4, 0.5)  # the next evaluation, before the commit
    m.wait()
    assert read_manifest(tmp_path / "global_step2")["eval"] == row(2, 1.0)


@pytest.mark.parametrize("greater", [False, True])
def test_greater_is_better_picks_the_other_checkpoint(tmp_path, tiny_module, greater):  # noqa: F811
    cfg = make_cfg(tmp_path, save_total_limit=1, eval_steps=2, save_steps=2)
    policy = BestPolicy("eval_perplexity", greater_is_better=greater)
    m, progress, _ = make_manager(cfg, tiny_module, best=policy)
    for step, loss in [(2, 1.0), (4, 3.0), (6, 2.0)]:
        save(m, progress, step, loss)
    kept = "global_step4" if greater else "global_step2"
    assert OutputDir(tmp_path).tags() == [kept, "global_step6"]


# --- bad input: exit 2 at start, one line naming the flags, nothing written ---------------------

BAD = [
    ("unknown_metric", ["--metric_for_best_model", "accuracy"], "--metric_for_best_model"),
    ("patience_0", ["--eval_steps", "2", "--early_stopping_patience", "0"], "patience"),
    ("threshold_negative", ["--early_stopping_threshold", "-1"], "--early_stopping_threshold"),
    ("threshold_alone", ["--early_stopping_threshold", "0.1"], "--early_stopping_patience"),
    ("patience_no_eval_steps", ["--early_stopping_patience", "2"], "--eval_steps"),
    (
        "save_not_multiple_of_eval",
        ["--eval_steps", "4", "--early_stopping_patience", "2", "--save_checkpoint"]
        + ["--save_steps", "6"],
        "--save_steps",
    ),
    (
        "metric_save_without_eval_steps",
        ["--metric_for_best_model", "loss", "--save_checkpoint", "--save_steps", "6"],
        "--eval_steps",
    ),
    (
        "no_eval_set",
        ["--train_file", "t.jsonl", "--validation_split_percentage", "0"]
        + ["--metric_for_best_model", "loss"],
        "--validation_split_percentage",
    ),
]


@pytest.mark.parametrize("case, argv, name", BAD, ids=[c[0] for c in BAD])
def test_bad_flags_are_config_errors_naming_the_flag(case, argv, name, tmp_path, monkeypatch):
    from finetune.cli import parse_train_args
    from finetune.config import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text('{"text": "a b c"}\n')
    with pytest.raises(ConfigError, match=name):
        parse_train_args([*argv, "--output_dir", "out"])
    assert not (tmp_path / "out").exists()


def test_good_flags_resolve(tmp_path, monkeypatch):
    from finetune.cli import parse_train_args

    cfg = parse_train_args(
        ["--eval_steps", "2", "--save_checkpoint", "--save_steps", "4"]
        + ["--early_stopping_patience", "3", "--early_stopping_threshold", "0.01"]
        + ["--metric_for_best_model", "perplexity", "--greater_is_better"]
    )
    assert BestPolicy.from_args(cfg.train) == BestPolicy("eval_perplexity", True, 3, 0.01)
    cfg = parse_train_args(["--no_greater_is_better", "--metric_for_best_model", "eval_loss"])
    assert cfg.train.greater_is_better is False
    # not asked for explicitly: a save between evaluations is fine (that checkpoint has no metric)
    parse_train_args(["--eval_steps", "4", "--save_checkpoint", "--save_steps", "6"])


def test_no_eval_set_after_loading_is_a_config_error():
    args = SimpleNamespace(early_stopping_patience=2, metric_for_best_model=None)
    with pytest.raises(best.ConfigError, match="--early_stopping_patience.*eval set"):
        best.require_evaluation(args, [])
    best.require_evaluation(args, [1])
    best.require_evaluation(
        SimpleNamespace(early_stopping_patience=None, metric_for_best_model=None), None
    )


def test_the_cli_exits_2_with_one_line_and_writes_nothing(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "--early_stopping_patience", "2"]
        + ["--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("finetune: error:") and "--eval_steps" in lines[-1]
    assert proc.stderr.count("finetune: error:") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# --- finetune ls and finetune export --best ------------------------------------------------------


def test_ls_marks_the_best_and_json_carries_it(tmp_path, tiny_module, capsys):  # noqa: F811
    import json

    from finetune import listing
    from finetune.offline.export import best_checkpoint

    cfg = make_cfg(tmp_path, eval_steps=2, save_steps=2)
    m, progress, _ = make_manager(cfg, tiny_module, best=BestPolicy())
    for step, loss in [(2, 2.0), (4, 1.25), (6, 3.0)]:
        save(m, progress, step, loss)
    found = listing.collect(tmp_path)
    assert [(c.tag, c.best) for c in found.checkpoints] == [
        ("global_step2", False),
        ("global_step4", True),
        ("global_step6", False),
    ]
    assert found.checkpoints[0].eval == row(2, 2.0)
    text = listing.render(found)
    marked = next(ln for ln in text.splitlines() if ln.split()[1:2] == ["4"])
    assert marked.startswith("+"), text
    assert "+ = the best: eval_loss 1.2500 (lower is better)" in text
    assert listing.main([str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["tag"] == "global_step4"
    assert [c["best"] for c in out["checkpoints"]] == [False, True, False]
    assert best_checkpoint(str(tmp_path)) == f"{tmp_path}/global_step4"


def test_export_best_without_an_evaluated_checkpoint_is_exit_2(tmp_path, tiny_module):  # noqa: F811
    from finetune.config import ConfigError
    from finetune.offline.export import main as export_main

    cfg = make_cfg(tmp_path / "run")
    m, progress, _ = make_manager(cfg, tiny_module, best=BestPolicy())
    save(m, progress, 2)  # saved without an evaluation
    with pytest.raises(ConfigError, match="`--best`: .* has no evaluated checkpoint"):
        export_main([str(tmp_path / "run"), str(tmp_path / "exported"), "--best"])
    assert not (tmp_path / "exported").exists()


def test_the_buckets_retention_keeps_the_best_the_newest_manifest_names():
    """Retention in the bucket on an object store in memory: the best outlives
    --save_total_limit 1."""
    import json

    from memory_storage import MemoryStorage

    from finetune.remote.retention import retain

    class Bucket(MemoryStorage):
        def remove_tree(self, rel: str) -> None:
            for name in [f for f in self.files if f.startswith(rel + "/")]:
                del self.files[name]
            self.dirs = {d for d in self.dirs if d != rel and not d.startswith(rel + "/")}

    bucket = Bucket()
    for seq, step in enumerate((2, 4, 6, 8), start=1):
        manifest = {"commit_seq": seq, "tag": f"global_step{step}", "total_bytes": 1}
        manifest["best"] = {"tag": "global_step4", "metric": "eval_loss", "value": 1.0}
        bucket.put(f"global_step{step}/manifest.json", json.dumps(manifest).encode())
        bucket.put(f"global_step{step}/model_states.pt")
    retain(bucket, "global_step8", limit=1)
    assert OutputDir(bucket).tags() == ["global_step4", "global_step8"]
