"""The boundary is physical: planner and schemas import with torch unimportable (docs/design.md §6.1)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCK_TORCH = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch.") or name == "triton":
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, _Block())
import cpplan.schemas, cpplan.planner
import cpplan.schemas.codec
assert "torch" not in sys.modules
print("ok")
"""


def test_planner_and_schemas_import_without_torch():
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_the_block_really_blocks():
    code = BLOCK_TORCH.replace("import cpplan.schemas, cpplan.planner", "import torch")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "blocked in this test" in proc.stderr

