#!/usr/bin/env bash
# Nsight Compute profile of the attention cases in bench/profile_kernels.py (GPU machine).
#   bash bench/profile.sh OUTDIR [case ...]      (default: every case)
# Writes OUTDIR/CASE.ncu-rep, OUTDIR/CASE.details.txt and prints a few lines per case.
# --clock-control none: the lent machine's clocks are left as found (device README).
set -u
out=${1:?usage: bench/profile.sh OUTDIR [case ...]}; shift
mkdir -p "$out"
cases=${*:-$(python3 bench/profile_kernels.py --list)}
for c in $cases; do
  ncu --clock-control none --profile-from-start off --set full --import-source no -f \
      -o "$out/$c" python3 bench/profile_kernels.py --case "$c" > "$out/$c.log" 2>&1 \
      || { echo "$c: ncu failed"; tail -5 "$out/$c.log"; continue; }
  ncu -i "$out/$c.ncu-rep" --page details > "$out/$c.details.txt" 2>&1
  echo "== $c"
  grep -E "^  [a-z_]|Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|Compute \(SM\) Throughput|L1/TEX Hit Rate|L2 Hit Rate|Local Memory|Warp Cycles Per Issued" \
      "$out/$c.details.txt" | head -40
  echo "   top stall reasons (warp cycles per issued instruction):"
  ncu -i "$out/$c.ncu-rep" --page raw 2>/dev/null \
    | grep -E "smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active.ratio" \
    | awk '{print $NF, $1}' | sort -rn | head -6 | sed 's/^/     /'
done
