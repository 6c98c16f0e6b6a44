"""The README's SLURM example, copied as written onto the test cluster, with only the flags changed."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, child_env
from slurm_cluster import slurm  # noqa: F401 — the fixture

pytestmark = pytest.mark.distributed

MARKER = "<!-- slurm-cpu-example"


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    block = text[text.index(MARKER):].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_slurm_example_trains_and_commits(slurm, tmp_path):
    command = readme_example()
    assert "sbatch" in command and "scripts/slurm/finetune.sbatch" in command
    # Only finetune's flags change: fewer steps. The user's working directory has scripts/.
    command = re.sub(r"--max_steps \d+ --save_steps \d+", "--max_steps 6 --save_steps 3", command)
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    env = slurm.env({**child_env(), "PYTHON": sys.executable})  # as after `source .venv/bin/activate`
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    info = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 420)
    log = (tmp_path / f"finetune-{job}.out").read_text()  # the log per job id, in the submit directory
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    assert "1 node(s) x 2 process(es)" in log
    out = tmp_path / "runs" / "slurm-demo"
    assert (out / "latest").read_text().strip() == "global_step6"
    assert sorted(p.name for p in out.glob("global_step*")) == ["global_step3", "global_step6"]
    state = json.loads((out / "global_step6" / "trainer_state.json").read_text())
    assert state["world_size"] == 2  # two srun tasks became two ranks
    check = subprocess.run([sys.executable, "-m", "finetune", "verify", str(out / "global_step6")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert (out / "logs" / f"slurm-{job}.log").stat().st_size > 0
    assert json.loads((out / "exit_status.json").read_text())["run_id"] == f"{job}.0"
