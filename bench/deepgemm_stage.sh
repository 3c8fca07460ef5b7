#!/usr/bin/env bash
# Stages the source tree bench/deepgemm_build.sh builds from, on a machine with git (and the
# network, or local clones), for a GPU machine without either:
#
#     bash bench/deepgemm_stage.sh [DEST]          # default: <repo>/.gpu (git ignores it)
#
# writes DEST/deepgemm (DeepGEMM's csrc/ and deep_gemm/, CUTLASS's include/, fmt's include/,
# SOURCES.txt naming the three commits) and DEST/deepgemm-src.tar.gz (about 3 MB) of it. On the
# GPU machine: `tar -xzf .gpu/deepgemm-src.tar.gz -C .gpu && bash bench/deepgemm_build.sh`.
#
# The commits are DeepGEMM's (DG_COMMIT) and the CUTLASS and fmt ones it pins as submodules,
# read from its tree. DG_REPO, CUTLASS_REPO and FMT_REPO name local clones to read from instead
# of cloning from GitHub (a clone must hold the commit). Any failure prints one line starting
# "deepgemm_stage: FAILED" and exits non-zero; DEST/deepgemm is replaced only once complete.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEST=${1:-$HERE/../.gpu}
DG_COMMIT=${DG_COMMIT:-54e2261}   # the commit bench/RESULTS.md's anchor figures were built from
fail() { echo "deepgemm_stage: FAILED: $*" >&2; exit 1; }
command -v git >/dev/null || fail "no git"
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)
WORK=$(mktemp -d "$DEST/.stage.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

repo() {  # NAME URL LOCAL -> a git directory holding NAME's history
    local dir=$3
    if [[ -z "$dir" ]]; then
        dir=$WORK/$1.git
        echo "cloning $2 (no local clone named)" >&2
        git clone -q --bare --filter=blob:none "$2" "$dir" >&2 || fail "git clone $2"
    fi
    git -C "$dir" rev-parse --git-dir >/dev/null 2>&1 || fail "$dir is not a git repository"
    echo "$dir"
}
pinned() {  # GITDIR COMMIT PATH -> the submodule commit at PATH in COMMIT's tree
    local line; line=$(git -C "$1" ls-tree "$2" "$3") || fail "no tree for $2 in $1"
    [[ $line == 160000\ commit\ * ]] || fail "$3 is not a submodule in $2 (got: ${line:-nothing})"
    echo "$line" | awk '{print $3}'
}
export_tree() {  # GITDIR COMMIT OUT PATH... -> the paths of COMMIT under OUT
    local g=$1 c=$2 out=$3; shift 3
    git -C "$g" cat-file -e "$c^{commit}" 2>/dev/null || fail "commit $c not in $g"
    mkdir -p "$out"
    git -C "$g" archive "$c" "$@" | tar -x -C "$out" || fail "git archive $c $* from $g"
}

DG=$(repo deepgemm https://github.com/deepseek-ai/DeepGEMM.git "${DG_REPO:-}")
DG_FULL=$(git -C "$DG" rev-parse --verify "$DG_COMMIT^{commit}" 2>/dev/null) \
    || fail "DeepGEMM commit $DG_COMMIT not in $DG"
CUTLASS_COMMIT=$(pinned "$DG" "$DG_FULL" third-party/cutlass)
FMT_COMMIT=$(pinned "$DG" "$DG_FULL" third-party/fmt)
CUTLASS=$(repo cutlass https://github.com/NVIDIA/cutlass.git "${CUTLASS_REPO:-}")
FMT=$(repo fmt https://github.com/fmtlib/fmt.git "${FMT_REPO:-}")

OUT=$WORK/deepgemm
export_tree "$DG" "$DG_FULL" "$OUT" csrc deep_gemm
export_tree "$CUTLASS" "$CUTLASS_COMMIT" "$OUT/third-party/cutlass" include
export_tree "$FMT" "$FMT_COMMIT" "$OUT/third-party/fmt" include
cat > "$OUT/SOURCES.txt" <<EOF
DeepGEMM $DG_FULL (deepseek-ai/DeepGEMM): csrc/, deep_gemm/
CUTLASS $CUTLASS_COMMIT (NVIDIA/cutlass, DeepGEMM's third-party/cutlass): include/
fmt $FMT_COMMIT (fmtlib/fmt, DeepGEMM's third-party/fmt): include/
EOF
tar -czf "$WORK/deepgemm-src.tar.gz" -C "$WORK" deepgemm
rm -rf "$DEST/deepgemm"
mv "$OUT" "$DEST/deepgemm"
mv "$WORK/deepgemm-src.tar.gz" "$DEST/deepgemm-src.tar.gz"
sed 's/^/source: /' "$DEST/deepgemm/SOURCES.txt"
echo "deepgemm_stage: OK: $DEST/deepgemm, $DEST/deepgemm-src.tar.gz ($(du -h "$DEST/deepgemm-src.tar.gz" | cut -f1))"
