"""`finetune verify`, `ls` and `export` exit with the same code for a local path and an s3:// URI,
case by case: the table in docs/CHECKPOINTS.md ("Exit codes of the subcommands"). One tree of
cases, built without training (a tiny model's ZeRO-3 rank files committed with a manifest), kept in
a folder and uploaded as it is to a real S3 server (SeaweedFS, ~3 s to start); the CLI's own
``main`` runs each case on both sides, in this process (a subprocess per case would cost seconds of
imports). A bucket that cannot be read (no server, a wrong bucket or credential) is exit 2 naming
the URI."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from s3_server import free_ports, require_s3

from finetune.checkpoint_format.outdir import STAGING, OutputDir
from finetune.cli import main
from finetune.io.durable import hash_file
from finetune.io.remote import S3Storage

from conftest import has_tmpfs_mount

require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "codes"
TREE = f"s3://{BUCKET}/tree"
TAG = "global_step2"
RANK_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"

# case: (its path under the tree, then the exit code of verify, ls and export)
CASES: dict[str, tuple[str, int, int, int]] = {
    "committed_checkpoint": (f"run/{TAG}", 0, 2, 0),
    "output_dir": ("run", 0, 0, 0),
    "damaged_checkpoint": (f"damaged/{TAG}", 1, 2, 2),
    "output_dir_newest_damaged": ("damaged", 1, 0, 2),
    "uncommitted_checkpoint": (f"uncommitted/{TAG}", 1, 2, 2),
    "uncommitted_checkpoint_named_otherwise": ("loose", 1, 2, 2),
    "output_dir_none_committed": ("uncommitted", 2, 0, 2),
    "output_dir_no_checkpoint": ("fresh", 2, 0, 2),
    "no_such_checkpoint": ("run/global_step99", 2, 2, 2),
    "no_such_folder": ("missing", 2, 2, 2),
    "not_a_checkpoint": ("folder", 2, 2, 2),
    "named_like_a_checkpoint_not_one": ("odd/global_step5", 2, 2, 2),
}
COMMANDS = ("verify", "ls", "export")


def _rank_files(folder: Path) -> None:
    """World size 1 in DeepSpeed's ZeRO-3 layout (what export rebuilds from): a tiny model's
    parameters as the fp32 flat group, cut in two, and its shapes in the model states."""
    torch.manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    groups = [OrderedDict((n, t.shape) for n, t in state.items() if t.dim() == d) for d in (2, 1)]
    flat = torch.cat([state[n].reshape(-1) for g in groups for n in g])
    model_states = {
        "module": OrderedDict((n, torch.empty(0)) for n in state),
        "buffer_names": [],
        "param_shapes": groups,
        "frozen_param_shapes": OrderedDict(),
        "frozen_param_fragments": OrderedDict(),
        "shared_params": {},
        "ds_version": "0.19.8",
    }
    optim = {
        "optimizer_state_dict": {
            "zero_stage": 3,
            "partition_count": 1,
            "fp32_flat_groups": [flat[:20].clone(), flat[20:].clone()],
            "optimizer_state_dict": {"state": {}, "param_groups": []},
        }
    }
    torch.save(model_states, folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    torch.save(optim, folder / RANK_FILE)
    torch.save({"python": 0}, folder / "rng_state_0.pt")
    config = {"model_type": "llama", "hidden_size": 4, "vocab_size": 8}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "trainer_state.json").write_text(json.dumps({"world_size": 1, "dtype": "fp32"}))


def _build(root: Path) -> None:
    """The cases' tree: ``run`` an output dir with one committed checkpoint; ``damaged`` a copy
    with a rank file cut short; ``uncommitted`` one without its manifest (a save or copy that
    never finished), ``loose`` the same under another name; ``fresh`` an output dir a run started
    and never saved to (its lease); ``folder`` and ``odd/global_step5`` something else."""
    out = OutputDir(root / "run")
    staged = out.root / STAGING / TAG
    staged.mkdir(parents=True)
    _rank_files(staged)
    out.commit(TAG, {p.name: hash_file(p) for p in staged.iterdir()}, 1, {})
    shutil.copytree(root / "run" / TAG, root / "damaged" / TAG)
    cut = root / "damaged" / TAG / RANK_FILE
    cut.write_bytes(cut.read_bytes()[:-8])
    shutil.copytree(root / "run" / TAG, root / "uncommitted" / TAG)
    (root / "uncommitted" / TAG / "manifest.json").unlink()
    shutil.copytree(root / "uncommitted" / TAG, root / "loose")
    (root / "fresh").mkdir()
    (root / "fresh" / ".lease").write_text("{}\n")
    (root / "folder").mkdir()
    (root / "folder" / "notes.txt").write_text("not a checkpoint\n")
    (root / "odd" / "global_step5").mkdir(parents=True)
    (root / "odd" / "global_step5" / "notes.txt").write_text("not a checkpoint either\n")
    shutil.rmtree(out.root / STAGING, ignore_errors=True)


@pytest.fixture(scope="module")
def tree(server, tmp_path_factory) -> Path:
    """The cases' tree in a folder, and the same files under TREE in the bucket."""
    root = tmp_path_factory.mktemp("codes") / "tree"
    _build(root)
    bucket = S3Storage(TREE, client=server.client())
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        bucket.upload_file(path, path.relative_to(root).as_posix(), hash_file(path)[1])
    return root


def cli(*argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``finetune ARGV``: the CLI's main, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _run(command: str, where: str, tmp_path: Path, side: str) -> tuple[int, str, str, Path]:
    dest = tmp_path / f"export-{side}"
    argv = (command, where, str(dest)) if command == "export" else (command, where)
    return (*cli(*argv), dest)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CASES)
def test_a_local_path_and_an_s3_uri_exit_alike(case, command, tree, aws_env, tmp_path):
    rel, *codes = CASES[case]
    want = codes[COMMANDS.index(command)]
    local, remote = str(tree / rel), f"{TREE}/{rel}"
    results = {
        "local": _run(command, local, tmp_path, "local"),
        "s3": _run(command, remote, tmp_path, "s3"),
    }
    for side, where in (("local", local), ("s3", remote)):
        code, stdout, stderr, dest = results[side]
        seen = f"{side} {command} {where}: exit {code}\n{stdout}{stderr}"
        assert code == want, seen
        if code == 2:  # one line naming what was given
            lines = stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("finetune: error: "), seen
            assert where in lines[0], seen
        if command == "export":
            assert dest.is_dir() == (code == 0), seen
    if command == "export" and want == 0:  # the same weights from either side, no download left
        from safetensors.torch import load_file

        a, b = (load_file(tmp_path / f"export-{s}" / "model.safetensors") for s in ("local", "s3"))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export-local", "export-s3"]
    if command == "verify" and want == 1:  # the same file named as damaged on both sides
        named = [results[s][1].splitlines()[1].split()[1].rstrip(":") for s in ("local", "s3")]
        assert named[0] == named[1], named


@pytest.fixture(params=["unreachable_endpoint", "wrong_bucket", "wrong_credential"])
def unreadable(request, server, tree, monkeypatch) -> str:
    """A URI of the tree's output dir that cannot be read, its environment set."""
    env = server.env()
    uri = f"{TREE}/run"
    if request.param == "unreachable_endpoint":
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens
    elif request.param == "wrong_bucket":
        uri = "s3://no-such-bucket/tree/run"
    else:
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return uri


@pytest.mark.parametrize(
    "argv",
    [("verify",), ("verify", "/TAG"), ("ls",), ("export", "OUT"), ("export", "OUT", "--best")],
)
def test_a_bucket_that_cannot_be_read_is_exit_2_naming_the_uri(argv, unreadable, tmp_path):
    uri = unreadable + (f"/{TAG}" if "/TAG" in argv else "")
    rest = [str(tmp_path / "out") if a == "OUT" else a for a in argv[1:] if a != "/TAG"]
    code, _, stderr = cli(argv[0], uri, *rest)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and uri in lines[0], (code, stderr)
    assert "not-the-secret" not in stderr, "credentials are never printed"
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


@pytest.mark.skipif(not has_tmpfs_mount(), reason="mounting a small tmpfs needs root and mount")
def test_export_from_s3_onto_a_full_disk_is_exit_1_as_from_a_folder(tree, aws_env, tmp_path):
    """The download beside OUT fills the disk: the local disk's failure (exit 1, OUT not
    created, the download removed), not bad input."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        for where in (str(tree / "run" / TAG), f"{TREE}/run/{TAG}"):
            code, _, stderr = cli("export", where, str(disk / "hf"))
            assert code == 1 and "was not written" in stderr, (where, code, stderr)
            assert list(disk.iterdir()) == [], where
    finally:
        subprocess.run(["umount", str(disk)], check=False)
