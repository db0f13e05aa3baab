"""The core (specs, plan, predictor, planner, CLI planning path) must run without torch."""

import subprocess
import sys


def test_core_imports_no_torch():
    code = (
        "import sys\n"
        "import hethub.cli, hethub.plan, hethub.spec, hethub.tables\n"
        "import hethub.predict.predictor, hethub.predict.links, hethub.predict.fit\n"
        "import hethub.search.planner, hethub.search.space\n"
        "import hethub.profile.format, hethub.profile.sailor\n"
        "hethub.cli.build_parser()\n"
        "assert 'torch' not in sys.modules, 'the core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_planning_command_runs_without_torch(tmp_path):
    """`hethub plan` end to end in a process where importing torch fails."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hethub.cli import main\n"
        f"sys.exit(main(['plan', '--cluster', {str(tmp_path / 'c.toml')!r}, '--model', 'tiny',\n"
        "               '--global-batch', '8', '--seq-len', '32', '--json']))\n"
    )
    (tmp_path / "c.toml").write_text('name = "x"\n[[group]]\nkind = "a100-40gb"\nnodes = 1\ndevices_per_node = 2\n')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"tokens_per_s"' in out.stdout
