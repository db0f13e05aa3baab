"""`hethub launch`: torchrun commands per node in the plan's rank order, and a Slurm script that a
node really executes (with stand-in `hostname` and `torchrun`)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import EXAMPLES
from hethub import cli
from hethub.commands.launch import node_launches
from hethub.plan import Pipeline, Plan, Stage
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model


def _plan(tmp_path: Path) -> Path:
    """Two kinds on two nodes of unequal use: 3 A100 ranks of node 0, then 2 S4000 ranks of node 2."""
    cluster = load_cluster(EXAMPLES / "nvidia-mthreads-32.toml")  # a100 nodes 0-1 (ids 0-15), s4000 nodes 2-3
    stages = (Stage("a100-80gb", (0, 1), (0, 16), embedding=True), Stage("a100-80gb", (2,), (16, 24)),
              Stage("mthreads-s4000", (16, 17), (24, 32), head=True))
    plan = Plan(model=get_model("llama-3-8b"), cluster=cluster, global_batch=8, seq_len=2048,
                pipelines=(Pipeline(1, 8, stages),)).validate()
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_commands_follow_the_rank_order(tmp_path, capsys):
    path = _plan(tmp_path)
    assert cli.main(["launch", "--plan", str(path), "--hosts", "gpu1,mt1", "--steps", "5", "--", "--lr", "1e-4"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("OMP_NUM_THREADS")]
    assert len(lines) == 2
    assert "--nnodes 2 --node-rank 0 --nproc-per-node 3 --master-addr gpu1" in lines[0]
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr gpu1" in lines[1]
    assert lines[1].endswith("-m hethub.train --plan " + str(path) + " --steps 5 --lr 1e-4")


def test_wrong_host_count_names_the_fix(tmp_path, capsys):
    path = _plan(tmp_path)
    assert cli.main(["launch", "--plan", str(path), "--hosts", "a,b,c"]) != 0
    err = capsys.readouterr().err
    assert "2 node(s)" in err and "Fix: pass exactly 2 distinct host names" in err


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_script_parses_and_each_node_gets_its_rank_count_and_env(tmp_path, capsys):
    path = _plan(tmp_path)
    out = tmp_path / "job.sbatch"
    assert cli.main(["launch", "--plan", str(path), "--hosts", "gpu1,mt1", "--slurm", "--out", str(out)]) == 0
    text = out.read_text()
    assert re.search(r"^#SBATCH --nodes=2$", text, re.M) and "#SBATCH --nodelist=gpu1,mt1" in text
    assert "needs torch_musa" in text
    # Run the per-node part as srun would on each host, with stand-ins that print what torchrun got.
    body = text.split("bash -c '", 1)[1].rsplit("'", 1)[0]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text('#!/bin/bash\necho "ARGS $*"\nenv | grep -E "^(MASTER_|NODE_RANK|NNODES|NPROC|OMP)" '
                                   "| sort\n")
    for host, rank, nproc in (("gpu1", 0, 3), ("mt1", 1, 2)):
        (fake / "hostname").write_text(f"#!/bin/bash\necho {host}\n")
        for f in fake.iterdir():
            f.chmod(0o755)
        env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
        got = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, check=True).stdout
        assert f"--nnodes 2 --node-rank {rank} --nproc-per-node {nproc} --master-addr gpu1 --master-port 29500" in got
        assert f"NODE_RANK={rank}" in got and f"NPROC_PER_NODE={nproc}" in got and "MASTER_ADDR=gpu1" in got
        assert "OMP_NUM_THREADS=1" in got and f"--plan {path}" in got
    (fake / "hostname").write_text("#!/bin/bash\necho stranger\n")
    bad = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "not in the plan host list" in bad.stderr


def test_node_layout_of_the_launch(tmp_path):
    plan = Plan.load(_plan(tmp_path))
    nodes = node_launches(plan, ["x", "y"])
    assert [(n.cluster_node, n.nproc, n.first_rank, n.kinds) for n in nodes] == [
        (0, 3, 0, ("a100-80gb",)), (2, 2, 3, ("mthreads-s4000",))]
