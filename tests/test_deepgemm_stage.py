"""bench/deepgemm_stage.sh against three toy repositories laid out like DeepGEMM (its submodules
as gitlinks), CUTLASS and fmt: the staged tree holds exactly the paths named at the pinned
commits, the tarball holds the same files, and a bad commit fails in one line leaving an
earlier staging as it was."""

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "deepgemm_stage.sh"
pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None,
                                reason="needs git and bash")

ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env={**os.environ, **ENV}).stdout.strip()


def make_repo(path, files, gitlinks=()):
    """A repository with one commit of FILES ({path: text}) and GITLINKS ((path, sha)) as
    submodule entries; returns the commit's sha."""
    path.mkdir(parents=True)
    git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
        git(path, "add", name)
    for name, sha in gitlinks:
        git(path, "update-index", "--add", "--cacheinfo", f"160000,{sha},{name}")
    git(path, "commit", "-q", "-m", "c")
    return git(path, "rev-parse", "HEAD")


def stage(dest, env):
    return subprocess.run(["bash", str(SCRIPT), str(dest)], capture_output=True, text=True,
                          env={**os.environ, **ENV, **env})


@pytest.fixture
def repos(tmp_path):
    cutlass_files = {"include/cute/a.hpp": "cute\n", "include/cutlass/b.h": "cutlass\n",
                     "tools/big.txt": "not staged\n"}
    fmt_files = {"include/fmt/base.h": "fmt\n", "src/format.cc": "not staged\n"}
    cutlass = make_repo(tmp_path / "cutlass", cutlass_files)
    fmt = make_repo(tmp_path / "fmt", fmt_files)
    dg_files = {"csrc/python_api.cpp": "api\n", "deep_gemm/__init__.py": "v = 1\n",
                "deep_gemm/include/deep_gemm/k.cuh": "kernel\n", "tests/t.py": "not staged\n"}
    dg = make_repo(tmp_path / "dg", dg_files,
                   [("third-party/cutlass", cutlass), ("third-party/fmt", fmt)])
    env = {"DG_REPO": str(tmp_path / "dg"), "CUTLASS_REPO": str(tmp_path / "cutlass"),
           "FMT_REPO": str(tmp_path / "fmt"), "DG_COMMIT": dg}
    want = {p: t for p, t in dg_files.items() if not p.startswith("tests/")}
    want |= {f"third-party/cutlass/{p}": t for p, t in cutlass_files.items()
             if p.startswith("include/")}
    want |= {f"third-party/fmt/{p}": t for p, t in fmt_files.items() if p.startswith("include/")}
    return env, want, (dg, cutlass, fmt)


def tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_stages_the_pinned_paths_and_a_tarball_of_them(tmp_path, repos):
    env, want, (dg, cutlass, fmt) = repos
    out = stage(tmp_path / "out", env)
    assert out.returncode == 0, out.stderr
    got = tree(tmp_path / "out" / "deepgemm")
    sources = got.pop("SOURCES.txt").decode()
    assert got == {p: t.encode() for p, t in want.items()}
    assert [line.split()[:2] for line in sources.splitlines()] == [
        ["DeepGEMM", dg], ["CUTLASS", cutlass], ["fmt", fmt]]
    with tarfile.open(tmp_path / "out" / "deepgemm-src.tar.gz") as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    assert names == {f"deepgemm/{p}" for p in [*want, "SOURCES.txt"]}
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".stage")]


def test_a_missing_commit_fails_in_one_line_and_keeps_the_earlier_staging(tmp_path, repos):
    env, want, _ = repos
    assert stage(tmp_path / "out", env).returncode == 0
    before = tree(tmp_path / "out")
    out = stage(tmp_path / "out", {**env, "DG_COMMIT": "0" * 40})
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"deepgemm_stage: FAILED: DeepGEMM commit {'0' * 40} not in {env['DG_REPO']}"]
    assert tree(tmp_path / "out") == before


def test_a_directory_that_is_not_a_repository_is_refused(tmp_path, repos):
    env, _, _ = repos
    (tmp_path / "plain").mkdir()
    out = stage(tmp_path / "out", {**env, "FMT_REPO": str(tmp_path / "plain")})
    assert out.returncode != 0
    assert f"deepgemm_stage: FAILED: {tmp_path / 'plain'} is not a git repository" in out.stderr
    assert not (tmp_path / "out" / "deepgemm").exists()
