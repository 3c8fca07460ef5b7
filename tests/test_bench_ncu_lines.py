"""bench/ncu_lines.py (ncu's per-instruction counters summed by source line, function and step)
on a hand-made kernel, disassembly and ncu export: every sum checked by hand."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

# loaded by its path: bench/ is not put on sys.path (test_bench_timeline.py says why)
_spec = importlib.util.spec_from_file_location(
    "cpplan_bench_ncu_lines", pathlib.Path(__file__).resolve().parents[1] / "bench" / "ncu_lines.py")
ncu_lines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_lines)

SOURCE = """\
// a kernel
namespace {
__device__ int helper(int x) {
  return x + 1;
}
template <int V>
__global__ void __launch_bounds__(128, 2)
kern(int* p) {
  // 1. the first step
  p[0] = helper(1);
  // 2. the second
  p[1] = 2;
}
struct Loads {
  __device__ static int at(const int* p) { return p[0]; }
};
}
"""

SASS = """\
//--------------------- .text._Z4kernPi --------------------------
\t.section\t.text._Z4kernPi,"ax",@progbits
.text._Z4kernPi:
\t//## File "/x/k.cu", line 8
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/x/k.cu", line 4
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
\t//## File "/x/k.cu", line 10
        /*0020*/                   STG.E desc[UR4][R4.64], R2 ;
\t//## File "/x/k.cu", line 12
        /*0030*/              @P0 STG.E desc[UR4][R4.64+0x4], R3 ;
\t//## File "/x/k.cu", line 15
        /*0040*/                   EXIT ;
.text._Z5otherv:
        /*0000*/                   NOP ;
"""

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_long_sb","stall_math","stall_math (Not Issued)"')
CSV = "\n".join([
    '"Kernel Name","void <unnamed>::kern<(int)4>(int *)"', HEADER,
    '"0x7f00","      LDC R1, c[0x0][0x28]","10","100","0","10","5"',
    '"0x7f10","      IADD3 R2, R2, 0x1, RZ","20","200","5","15","0"',
    '"0x7f20","      STG.E desc[UR4][R4.64], R2","30","300","30","0","0"',
    '"0x7f30","      @P0 STG.E desc[UR4][R4.64+0x4], R3","25","350","0","25","0"',
    '"0x7f40","      EXIT","15","50","0","0","0"',
    '"Kernel Name","void other()"', HEADER,
    '"0x8000","      MOV R1, R2","1","1","0","0","0"',
]) + "\n"


@pytest.fixture
def files(tmp_path):
    for name, text in (("k.cu", SOURCE), ("k.sass", SASS), ("k.csv", CSV)):
        (tmp_path / name).write_text(text)
    return tmp_path


def test_groups_name_functions_steps_and_structs():
    g = ncu_lines.groups(SOURCE)
    assert [g[n] for n in (3, 4, 8, 9, 10, 11, 12, 14, 15)] == [
        "helper", "helper", "kern", "kern, step 1", "kern, step 1", "kern, step 2",
        "kern, step 2", "struct Loads", "struct Loads"]
    assert g[1] == "(file)"


def test_sums_by_group_and_line(files, capsys):
    rc = ncu_lines.main(["--csv", str(files / "k.csv"), "--source", str(files / "k.cu"),
                         "--sass", str(files / "k.sass"), "--top", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    # 100 samples, 1000 warp instructions; the group rows by samples, their shares by hand
    assert "   100 samples, 0.0 M warp instructions" in lines
    rows = [ln.split() for ln in lines if ln.startswith("   ") and "%" in ln and "L" not in ln.split()[2][:1]]
    got = {" ".join(r[2:]).split(" [")[0]: (r[0], r[1]) for r in rows}
    assert got == {"kern, step 1": ("30.0%", "30.0%"), "kern, step 2": ("25.0%", "35.0%"),
                   "helper": ("20.0%", "20.0%"), "struct Loads": ("15.0%", "5.0%"),
                   "kern": ("10.0%", "10.0%")}
    assert "kern, step 1 [long_sb 100%]" in out
    assert "helper [math 75%, long_sb 25%]" in out  # Not Issued columns not counted again
    # the top two lines, by samples
    top = [ln for ln in lines if ": " in ln and " L" in ln]
    assert [t.split("L", 1)[1].split(":")[0] for t in top] == ["10", "12"]
    # the second block repeats no function's opcodes
    assert "== void other(): no function of the disassembly has its 1 instructions" in out


@pytest.mark.parametrize("case,expect", [
    ("missing", "no such file"),
    ("no-columns", "column 'Instructions Executed' missing"),
    ("no-kernel", "no 'Kernel Name' block"),
])
def test_bad_input_is_one_line_and_exit_2(files, capsys, case, expect):
    csv_path = files / "k.csv"
    if case == "missing":
        csv_path = files / "absent.csv"
    elif case == "no-columns":
        csv_path.write_text('"Kernel Name","k"\n"Address","Source","Warp Stall Sampling (All '
                            'Samples)"\n"0x0","EXIT","1"\n')
    else:
        csv_path.write_text('"Address","Source"\n')
    rc = ncu_lines.main(["--csv", str(csv_path), "--source", str(files / "k.cu"),
                         "--sass", str(files / "k.sass")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("ncu_lines: ") and expect in err[0]
