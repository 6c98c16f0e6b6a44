"""tests/spawn_ranks.py's zygote takes a launch only when its environment is the zygote's in all
that imports may read: what tests' own processes change as they run must not make it refuse."""

from __future__ import annotations

import os

import spawn_ranks

from conftest import _SESSION_ENV, BIN, child_env


def _zygote() -> tuple[dict, dict]:
    """The zygote's view: the session's environment, and what this process's imports set since
    (as the zygote's own imports did). Taken before a test changes anything."""
    own = spawn_ranks._import_env(child_env(base=_SESSION_ENV))
    added = {k: v for k, v in os.environ.items() if k not in _SESSION_ENV}
    return own, added


def test_a_run_after_finetunes_op_setup_in_this_process_is_the_zygotes(monkeypatch):
    own, added = _zygote()
    # finetune.ops puts the venv's bin first in os.environ; finetune's console sets the libraries'
    # verbosity: both happen in a test's own process when it runs finetune's code there
    monkeypatch.setenv("PATH", os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "warning")
    monkeypatch.setenv("DATASETS_VERBOSITY", "warning")
    env = child_env({"FINETUNE_FAULT": "save.fsync:0:2", "AWS_ACCESS_KEY_ID": "key"})
    assert spawn_ranks._differ(own, added, env) == []


def test_what_imports_read_is_refused(monkeypatch):
    own, added = _zygote()
    monkeypatch.setenv("HF_HOME", "/elsewhere")
    env = child_env({"OMP_NUM_THREADS": "2"})
    assert spawn_ranks._differ(own, added, env) == ["HF_HOME", "OMP_NUM_THREADS"]


def test_what_the_imports_set_themselves_is_not_a_difference():
    own, added = _zygote()
    added["A_LIBRARYS_CACHE"] = "/tmp/cache"  # set by the zygote's imports
    assert spawn_ranks._differ(own, added, child_env({"A_LIBRARYS_CACHE": "/tmp/cache"})) == []
    assert spawn_ranks._differ(own, added, child_env({"A_LIBRARYS_CACHE": "/x"})) == [
        "A_LIBRARYS_CACHE"
    ]
