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


@pytest.mark.parametrize("hosts", ["gpu1;rm -rf ~,mt1", "gpu 1,mt1", "gpu1,$(id)", "gpu1,mt1-", "gpu1,mt1'"])
def test_host_names_are_checked(tmp_path, capsys, hosts):
    path = _plan(tmp_path)
    assert cli.main(["launch", "--plan", str(path), "--hosts", hosts]) == 2
    err = capsys.readouterr()
    assert "is not a host name" in err.err and "OMP_NUM_THREADS" not in err.out


@pytest.mark.parametrize("args", [["--steps", "0"], ["--", "--no-such-flag"], ["--", "--lr", "-1"],
                                  ["--", "--warmup-steps", "500"]])
def test_training_arguments_are_checked_by_the_ranks_parser_before_printing(tmp_path, capsys, args):
    path = _plan(tmp_path)
    try:
        code = cli.main(["launch", "--plan", str(path), "--hosts", "gpu1,mt1", *args])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    out = capsys.readouterr()
    assert code == 2 and "OMP_NUM_THREADS" not in out.out and "Traceback" not in out.err


def test_arguments_are_quoted_in_the_printed_commands(tmp_path, capsys):
    path = _plan(tmp_path)
    odd = tmp_path / "a dir" / "plan;x.json"
    odd.parent.mkdir()
    odd.write_text(path.read_text())
    assert cli.main(["launch", "--plan", str(odd), "--hosts", "gpu1,mt1", "--", "--metrics", "m $HOME.jsonl"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("OMP_NUM_THREADS"))
    import shlex

    words = shlex.split(line)
    assert str(odd) in words and "m $HOME.jsonl" in words


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_script_runs_under_a_fake_srun_and_requests_the_plans_devices(tmp_path, capsys):
    path = _plan(tmp_path)
    (tmp_path / "jobs").mkdir()
    assert cli.main(["launch", "--plan", str(path), "--hosts", "gpu1,mt1", "--slurm", "--out",
                     str(tmp_path / "jobs") + "/", "--time", "02:00:00", "--partition", "gpu", "--account", "proj",
                     "--cpus-per-rank", "4", "--env-setup", "export HETHUB_ENV_READY=yes", "--steps", "100",
                     "--", "--metrics", "run.jsonl"]) == 0
    script = tmp_path / "jobs" / "plan.sbatch"
    text = script.read_text()
    # node 0 runs 3 A100 ranks (cuda), node 1 two S4000 ranks (musa): the busiest node's request.
    for line in ("#SBATCH --gpus-per-node=3", "#SBATCH --gres=musa:2", "#SBATCH --cpus-per-task=12",
                 "#SBATCH --time=02:00:00", "#SBATCH --partition=gpu", "#SBATCH --account=proj"):
        assert re.search(f"^{re.escape(line)}$", text, re.M), line
    # A fake srun runs its command once per node, each under that node's host name; a fake torchrun
    # prints what it got.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                               'for h in gpu1 mt1; do FAKE_HOST=$h "$@" > "$OUT_DIR/$h.out" 2>&1 || exit 1; done\n')
    (fake / "hostname").write_text('#!/bin/bash\necho "$FAKE_HOST"\n')
    (fake / "torchrun").write_text('#!/bin/bash\necho "ENV_READY=$HETHUB_ENV_READY NODE_RANK=$NODE_RANK"\n'
                                   'echo "ARGS $*"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT_DIR": str(tmp_path)}
    subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True, text=True)
    for host, rank, nproc in (("gpu1", 0, 3), ("mt1", 1, 2)):
        got = (tmp_path / f"{host}.out").read_text()
        assert f"ENV_READY=yes NODE_RANK={rank}" in got
        assert (f"ARGS --nnodes 2 --node-rank {rank} --nproc-per-node {nproc} --master-addr gpu1 --master-port 29500 "
                f"-m hethub.train --plan {path} --steps 100 --metrics run.jsonl") in got
