"""What a resume from the bucket counts as already in OUT (fetch.holds): the same commit,
holding what this OUT needs, a node's cut or the whole checkpoint. No server needed."""

from __future__ import annotations

from finetune.remote.fetch import holds

WHOLE = {"save_id": "run-7", "world_size": 2}
CUT0 = {**WHOLE, "ranks": [0]}


def test_the_same_commit_holding_what_this_out_needs_is_here():
    assert holds(WHOLE, "run-7", None)  # shared storage: the whole checkpoint
    assert holds(CUT0, "run-7", [0])  # node-local, same world size: this node's cut
    assert holds(WHOLE, "run-7", [0])  # a whole copy holds every cut


def test_a_cut_is_not_the_whole_checkpoint_another_world_size_needs():
    # node-local at another world size needs every rank's files on every node: its cut is not
    # enough (it was counted as here, and the resume then refused the world size)
    assert not holds(CUT0, "run-7", None)
    assert not holds(CUT0, "run-7", [1])  # ranks placed on other nodes than when saved


def test_another_commit_or_nothing_is_not_here():
    assert not holds({**WHOLE, "save_id": "run-6"}, "run-7", None)
    assert not holds({}, "run-7", None)
