"""The GPU script is ready to run and skips cleanly where there is no GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the script would run its checks")
def test_gpu_check_skips_cleanly_without_cuda():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "skipped: no CUDA"


def test_gpu_check_plans_cover_what_the_issue_asks():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    names = [n for n, _ in gpu_check.plans(gpus=2, cpu_only=False)]
    assert names[0].startswith("cuda-only") and "NCCL" in names[0]
    assert [n for n in names if n.startswith("cuda+cpu")] == ["cuda+cpu fp32", "cuda+cpu bf16-mixed",
                                                                 "cuda+cpu fp16-mixed"]
    for _, plan in gpu_check.plans(gpus=1, cpu_only=False):
        assert plan.cluster.kinds["gpu"].device_type == "cuda"
