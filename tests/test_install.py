"""The install story: `import vkattn` without kp, and `import vkattn.hf` without torch/transformers,
stop with an ImportError naming what to run; scripts/install.sh puts vkattn (and kp) into a fresh
venv where a bare `pip install .` leaves it unusable."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a meta-path finder that makes the named top-level packages unimportable, as if not installed
BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {names!r}:
            raise ModuleNotFoundError('No module named ' + repr(name), name=name)
sys.meta_path.insert(0, Block())
"""


def run(python, code, block=(), cwd=ROOT):
    src = (BLOCK.format(names=set(block)) if block else "") + code
    return subprocess.run([str(python), "-c", src], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_import_without_kp_names_the_install_command():
    r = run(sys.executable, "import vkattn", block=["kp"])
    assert r.returncode != 0
    assert "ImportError: vkattn needs Kompute's Python module kp 0.9.0" in r.stderr
    assert f"bash scripts/install.sh {sys.prefix}" in r.stderr


def test_import_hf_without_the_extra_says_what_to_install():
    r = run(sys.executable, "import vkattn\nprint('core ok')\nimport vkattn.hf", block=["torch", "transformers"])
    assert "core ok" in r.stdout and r.returncode != 0
    assert "ImportError: vkattn.hf needs torch and transformers" in r.stderr
    assert "pip install torch 'transformers>=5.23,<6'" in r.stderr


def sh(*cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, cwd=ROOT, **kw)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_install_script_into_a_fresh_venv(tmp_path):
    """A bare `pip install .` installs but `import vkattn` stops naming the script; the script then
    makes it work (kp from the wheel cache scripts/setup.sh filled, or built once)."""
    venv = tmp_path / "user venv"                    # a space in the path, as users have
    sh(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    sh(py, "-m", "pip", "install", "-q", ".", env=env)
    r = run(py, "import vkattn", cwd=tmp_path)          # not the clone: the installed package
    assert r.returncode != 0 and f"bash scripts/install.sh {venv}" in r.stderr
    sh("bash", "scripts/install.sh", venv, env=env)
    r = run(py, "import numpy as np, vkattn\n"
                "c = vkattn.KVCache(8, 1, 8, dtype='float32')\n"
                "x = np.ones((1, 3, 8), np.float32)\n"
                "print(float(c.forward(x, x, x)[0, 2, 0]))", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "1.0", r.stderr
    sh("bash", "scripts/install.sh", venv, env=env)   # again: nothing to do, still fine
