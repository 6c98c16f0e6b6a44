"""tests/spawn_ranks.py's zygote takes a launch only when its environment is the zygote's in all
that imports may read: what tests' own processes change as they run must not make it refuse."""

from __future__ import annotations

import os

import spawn_ranks

from conftest import _SESSION_ENV, BIN, child_env


def _differ(env: dict) -> list[str]:
    """What the zygote, started with the session's environment, refuses in a run's ``env``."""
    own = spawn_ranks._import_env(child_env(base=_SESSION_ENV))
    return spawn_ranks._differ(own, {}, env)


def test_a_run_after_finetunes_op_setup_in_this_process_is_the_zygotes(monkeypatch):
    # finetune.ops puts the venv's bin first in os.environ; finetune's console sets the libraries'
    # verbosity: both happen in a test's own process when it runs finetune's code there
    monkeypatch.setenv("PATH", os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "warning")
    monkeypatch.setenv("DATASETS_VERBOSITY", "warning")
    env = child_env({"FINETUNE_FAULT": "save.fsync:0:2", "AWS_ACCESS_KEY_ID": "key"})
    assert _differ(env) == []


def test_what_imports_read_is_refused(monkeypatch):
    monkeypatch.setenv("HF_HOME", "/elsewhere")
    assert _differ(child_env({"OMP_NUM_THREADS": "2"})) == ["HF_HOME", "OMP_NUM_THREADS"]


def test_what_the_imports_set_themselves_is_not_a_difference():
    added = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}
    own = spawn_ranks._import_env(child_env(base=_SESSION_ENV))
    assert spawn_ranks._differ(own, added, child_env(added)) == []
    assert spawn_ranks._differ(own, added, child_env({"TORCHINDUCTOR_CACHE_DIR": "/x"})) == [
        "TORCHINDUCTOR_CACHE_DIR"
    ]
