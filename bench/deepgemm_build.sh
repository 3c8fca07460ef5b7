#!/usr/bin/env bash
# Builds DeepGEMM (deepseek-ai/DeepGEMM) from a staged source tree into a plain package folder,
# offline, for bench/indexer.py --deepgemm (the fp8_mqa_logits anchor):
#
#     bash bench/deepgemm_build.sh [SRC [TARGET]]     # defaults: <repo>/.gpu/deepgemm /tmp/site
#     PYTHONPATH=/tmp/site python3 bench/indexer.py --quick --only prefill --deepgemm
#
# SRC holds DeepGEMM's csrc/, deep_gemm/ (the Python package and its include/deep_gemm),
# third-party/cutlass/include/{cute,cutlass} and third-party/fmt/include/fmt, as staged from
# the DeepGEMM commit and the CUTLASS / fmt commits it pins as submodules (SRC/SOURCES.txt
# names them; `bash bench/deepgemm_stage.sh` stages it, and a tarball of it, on a machine with
# git); nothing of it is in this repository. The one C++ translation unit
# (csrc/python_api.cpp) is compiled against the installed torch with its own ninja build
# (torch.utils.cpp_extension, no setup.py: that one wants wheel, git and the network), the
# package is copied to TARGET/deep_gemm with the CUTLASS headers under deep_gemm/include (where
# its kernel JIT looks for them), and TARGET/deep_gemm/envs.py records CUDA_HOME and
# DG_JIT_CACHE_DIR for the JIT, which compiles each kernel with nvcc at its first call. A
# smoke test then imports the package and checks fp8_mqa_logits on a small case against torch.
# Any failure prints one line starting "deepgemm_build: FAILED" and exits non-zero. DG_CFLAGS
# adds compiler flags (e.g. -DDG_JIT_USE_RUNTIME_API: kernels loaded and launched through the
# CUDA runtime instead of DeepGEMM's dlsym'd driver calls); DG_CXX names the host compiler (see
# "pick the host compiler").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${1:-${DG_SRC:-$HERE/../.gpu/deepgemm}}
[[ -d "$SRC" ]] && SRC=$(cd "$SRC" && pwd)
TARGET=${2:-${DG_TARGET:-/tmp/site}}
JIT_CACHE=${DG_JIT_CACHE_DIR:-/tmp/deepgemm-jit}
BUILD=${DG_BUILD_DIR:-/tmp/deepgemm-build}
PY=${PYTHON:-python3}
STEP="start"
trap 'echo "deepgemm_build: FAILED at step \"$STEP\" (exit $?; output above)" >&2' ERR
fail() { echo "deepgemm_build: FAILED: $*" >&2; trap - ERR; exit 1; }
t0=$(date +%s)

STEP="pick the host compiler"
# torch.utils.cpp_extension compiles with $CXX (else c++). On the lent H200 that is a wrapper
# script pointing g++ at a private toolchain (-B /opt/gcc/...); the module it built crashed at
# its first call inside libstdc++ code (std::regex's compiler, under DeepGEMM's include
# parser), one built by the system's /usr/bin/g++ did not (bench/RESULTS.md). So: DG_CXX if
# set; else $CXX (or c++) unless it is such a wrapper, in which case /usr/bin/g++.
is_wrapper() {  # a compiler command that is a shell script passing -B (a private toolchain)
    local f; f=$(command -v "$1" 2>/dev/null) || return 1; f=$(readlink -f "$f")
    [[ $(head -c 2 "$f" 2>/dev/null) == "#!" ]] && grep -q -- " -B" "$f"
}
CXX=${DG_CXX:-${CXX:-c++}}
if [[ -z "${DG_CXX:-}" ]] && is_wrapper "$CXX" && [[ -x /usr/bin/g++ ]]; then
    echo "host compiler: $CXX wraps a private toolchain (-B): /usr/bin/g++ instead (DG_CXX overrides)"
    CXX=/usr/bin/g++
fi
export CXX

STEP="find nvcc"
# CUDA_HOME: $CUDA_HOME if set, else the toolkit of the nvcc on PATH (through symlinks, and
# through a wrapper script that execs another nvcc), else /usr/local/cuda, else the newest
# /usr/local/cuda-*; it must hold bin/nvcc and include/cuda.h (the kernel JIT runs that nvcc)
toolkit_of() {  # an nvcc path -> its toolkit root, or nothing
    local n; n=$(readlink -f "$1" 2>/dev/null) || return 0
    if [[ -f "$(dirname "$(dirname "$n")")/include/cuda.h" ]]; then
        dirname "$(dirname "$n")"
    elif [[ $(head -c 2 "$n" 2>/dev/null) == "#!" ]]; then  # a wrapper: the nvcc it execs
        local t; t=$(grep -o '/[^ "]*/bin/nvcc' "$n" | head -1)
        [[ -n "$t" && "$t" != "$n" ]] && toolkit_of "$t"
    fi
    return 0
}
cands=()
[[ -n "${CUDA_HOME:-}" ]] && cands+=("$CUDA_HOME/bin/nvcc")
command -v nvcc >/dev/null && cands+=("$(command -v nvcc)")
cands+=(/usr/local/cuda/bin/nvcc)
while IFS= read -r c; do cands+=("$c"); done < <(ls -d /usr/local/cuda-*/bin/nvcc 2>/dev/null | sort -rV)
CUDA_HOME=
for c in "${cands[@]}"; do
    CUDA_HOME=$(toolkit_of "$c")
    [[ -n "$CUDA_HOME" && -x "$CUDA_HOME/bin/nvcc" ]] && break
    CUDA_HOME=
done
[[ -n "$CUDA_HOME" ]] || fail "no CUDA toolkit (bin/nvcc with include/cuda.h) from: ${cands[*]}"
export CUDA_HOME
NVCC=$CUDA_HOME/bin/nvcc
export PATH=$CUDA_HOME/bin:$PATH
LIBDIR=$CUDA_HOME/lib64
[[ -d "$LIBDIR" ]] || LIBDIR=$CUDA_HOME/lib
echo "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*, V[0-9.]*'))"
echo "CUDA_HOME: $CUDA_HOME; host compiler: $CXX ($("$CXX" --version | head -1))"
"$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__} '\
'(CUDA {torch.version.cuda}, cxx11 abi {torch.compiled_with_cxx11_abi()})")' \
    || fail "python3 cannot import torch"
command -v ninja >/dev/null || "$PY" -c 'import ninja' 2>/dev/null || fail "no ninja"

STEP="check the staged source"
for f in csrc/python_api.cpp deep_gemm/__init__.py deep_gemm/include/deep_gemm \
         third-party/cutlass/include/cute third-party/cutlass/include/cutlass \
         third-party/fmt/include/fmt; do
    [[ -e "$SRC/$f" ]] || fail "$SRC/$f missing: stage DeepGEMM's source tree there first (bench/deepgemm_stage.sh)"
done
[[ -f "$SRC/SOURCES.txt" ]] && sed 's/^/source: /' "$SRC/SOURCES.txt"

STEP="compile csrc/python_api.cpp"
mkdir -p "$BUILD"
t1=$(date +%s)
DG_SRC="$SRC" DG_BUILD="$BUILD" DG_LIB="$LIBDIR" "$PY" - <<'EOF'
import glob
import importlib.util
import os
import sys

from torch.utils import cpp_extension

src, build, lib, cuda = (os.environ[k] for k in ("DG_SRC", "DG_BUILD", "DG_LIB", "CUDA_HOME"))
# headers and libraries beyond the toolkit's: a toolkit assembled from pip packages may lack
# nvrtc / cuBLAS(Lt) / cuSPARSE / cuSOLVER, which torch's own CUDA wheels bring (site-packages'
# nvidia/cu13/{include,lib}, or nvidia/<lib>/{include,lib} for CUDA 12)
spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations) if spec else []
HEADERS = ("cuda.h", "nvrtc.h", "cublasLt.h", "cublas_v2.h", "cusparse.h", "cusolverDn.h")
incs = [f"{cuda}/include", f"{cuda}/include/cccl"] + sorted(
    d for r in roots for d in glob.glob(f"{r}/*/include")
    if any(os.path.exists(f"{d}/{h}") for h in HEADERS[1:]))
libs = [lib] + sorted(d for r in roots for d in glob.glob(f"{r}/*/lib"))
for h in HEADERS:
    if not any(os.path.exists(f"{d}/{h}") for d in incs):
        sys.exit(f"no {h} in {incs}")
# the unversioned names the link wants (a pip library ships libX.so.N only): links in BUILD/lib
link = os.path.join(build, "lib")
os.makedirs(link, exist_ok=True)
rpaths = []
for name in ("cudart", "nvrtc"):
    found = [f for d in libs for f in sorted(glob.glob(f"{d}/lib{name}.so*")) if "builtins" not in f
             and "alt" not in os.path.basename(f)]
    if not found:
        sys.exit(f"no lib{name}.so* in {libs}")
    dst = os.path.join(link, f"lib{name}.so")
    if os.path.lexists(dst):
        os.remove(dst)
    os.symlink(os.path.realpath(found[0]), dst)
    rpaths.append(os.path.dirname(found[0]))
    print(f"lib{name}: {found[0]}")
print("include:", *incs)
# DeepGEMM's own flags (its setup.py: C++17, -O3, its include dirs, cudart and nvrtc); torch
# adds its includes, the ABI define and the torch / c10 (CUDA) libraries; the rpaths find the
# CUDA libraries at run time
cpp_extension.load(
    name="_C", sources=[f"{src}/csrc/python_api.cpp"], build_directory=build, with_cuda=True,
    extra_cflags=["-std=c++17", "-O3", "-Wno-psabi", "-Wno-deprecated-declarations"]
    + os.environ.get("DG_CFLAGS", "").split(),
    extra_include_paths=incs + [f"{src}/deep_gemm/include", f"{src}/third-party/cutlass/include",
                                f"{src}/third-party/fmt/include"],
    extra_ldflags=[f"-L{link}", "-lcudart", "-lnvrtc"]
    + [f"-Wl,-rpath,{d}" for d in dict.fromkeys(rpaths)],
    is_python_module=False, verbose=True)
EOF
SO=$BUILD/_C.so
[[ -f "$SO" ]] || fail "no $SO after the build"
echo "compiled $SO in $(( $(date +%s) - t1 )) s"
# the module should use the process's libstdc++ (torch's): one linked into it is a second copy
command -v readelf >/dev/null && { readelf -d "$SO" | grep -q 'libstdc++' \
    || echo "warning: $SO does not load libstdc++.so: its own copy may clash with torch's"; }

STEP="assemble $TARGET/deep_gemm"
mkdir -p "$TARGET"
rm -rf "$TARGET/deep_gemm"
cp -r "$SRC/deep_gemm" "$TARGET/deep_gemm"
cp -r "$SRC/third-party/cutlass/include/cute" "$SRC/third-party/cutlass/include/cutlass" \
    "$TARGET/deep_gemm/include/"
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cp "$SO" "$TARGET/deep_gemm/_C$SUFFIX"
mkdir -p "$JIT_CACHE"
cat > "$TARGET/deep_gemm/envs.py" <<EOF
# written by bench/deepgemm_build.sh: defaults for the kernel JIT (the environment wins)
persistent_envs = {'CUDA_HOME': '$CUDA_HOME', 'DG_JIT_CACHE_DIR': '$JIT_CACHE'}
EOF

STEP="smoke test (import, one fp8_mqa_logits against torch)"
t2=$(date +%s)
PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
import torch

import deep_gemm

print(f"deep_gemm {deep_gemm.__version__} from {deep_gemm.__file__}")
g = torch.Generator(device="cuda").manual_seed(0)
T, N, H, D = 64, 1024, 64, 128
q = torch.randint(-2, 3, (T, H, D), device="cuda", generator=g).float()
k = torch.randint(-3, 4, (N, D), device="cuda", generator=g).float()
s = torch.full((N,), 0.5, device="cuda")
w = torch.randint(-2, 3, (T, H), device="cuda", generator=g).float()
ks = torch.zeros(T, dtype=torch.int32, device="cuda")
ke = torch.arange(N - T + 1, N + 1, dtype=torch.int32, device="cuda")
got = deep_gemm.fp8_mqa_logits(q.to(torch.float8_e4m3fn), (k.to(torch.float8_e4m3fn), s), w,
                               ks, ke, clean_logits=True)
want = torch.einsum("thd,nd->thn", q, k * s[:, None]).relu().mul(w[:, :, None]).sum(1)
cols = torch.arange(N, device="cuda")[None, :]
want = want.masked_fill((cols < ks[:, None].long()) | (cols >= ke[:, None].long()), float("-inf"))
assert got.shape == (T, N), got.shape
assert torch.equal(got, want), f"max |diff| {(got - want).nan_to_num().abs().max().item()}"
print("fp8_mqa_logits == torch on T 64 N 1024 (integer inputs, exact)")
EOF
echo "smoke test (with the JIT's first nvcc compiles) took $(( $(date +%s) - t2 )) s"
trap - ERR
echo "deepgemm_build: OK in $(( $(date +%s) - t0 )) s: PYTHONPATH=$TARGET" \
     "(jit cache $JIT_CACHE)"
