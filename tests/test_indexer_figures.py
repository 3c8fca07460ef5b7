"""bench/indexer_figures.sh's refusals, without a GPU: no nvidia-smi is one FAILED line (exit 1),
and a card whose name lacks CARD runs nothing (exit 0), told by a fake nvidia-smi."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "indexer_figures.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path, path, **env):
    return subprocess.run([shutil.which("bash"), str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": path, "OUT": str(tmp_path / "out"), **env})


def test_no_nvidia_smi_is_one_failed_line(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):  # what the script needs before it looks for the GPU
        (bin_dir / tool).symlink_to(shutil.which(tool))
    res = _run(tmp_path, str(bin_dir))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "indexer_figures: FAILED: no nvidia-smi: this runs on a GPU machine"]


def test_another_card_than_asked_runs_nothing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 1980 MHz, 700.00 W'\n")
    smi.chmod(0o755)
    res = _run(tmp_path, f"{bin_dir}:{os.environ['PATH']}", CARD="H200")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["card: NVIDIA H100 80GB HBM3, 1980 MHz, 700.00 W",
                                       "indexer_figures: not a H200 card: nothing run"]
    assert not (tmp_path / "out").exists()
