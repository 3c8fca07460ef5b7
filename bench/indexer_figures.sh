#!/usr/bin/env bash
# Issue 33's GPU figures in one device call, most needed first, each part's output written to
# OUT (default ./indexer-figures) as it ends, so a call cut off keeps what it finished:
#
#     bash bench/indexer_figures.sh            # ~330 s on a fresh H200 or H100
#     CARD=H200 bash bench/indexer_figures.sh  # run nothing unless the card's name holds H200
#
# 1. the prefill indexer at T 4096 x N 32768, 2048 x 65536, 8192 x 8192, with the ws logits
#    rows (bench/indexer.py --quick --only prefill; the card's bf16 / fp8 ceilings with it);
# 2. the 32k-prompt step, FlashMLA attention (bench/step_gpu.py --layers 4 --repeat 3);
# 3. the decode indexer in a CUDA graph, 8 x 128k and 64 x 4k;
# 4. DeepGEMM's fp8_mqa_logits (+ torch.topk) beside the default at T 4096 x N 32768, built from
#    .gpu/deepgemm-src.tar.gz (bash bench/deepgemm_stage.sh) by bench/deepgemm_build.sh; the
#    part says why in one line where the source is not staged.
# Wheels under .whl (msgspec, sgl-flash-mla: the device image lacks them) are installed into
# /tmp/site first. Any failure to start prints one line starting "indexer_figures: FAILED".
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
fail() { echo "indexer_figures: FAILED: $*" >&2; exit 1; }
command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this runs on a GPU machine"
card=$(nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | head -1)
echo "card: $card"
if [[ -n "${CARD:-}" && "$card" != *"$CARD"* ]]; then
    echo "indexer_figures: not a $CARD card: nothing run"
    exit 0
fi
OUT=$(mkdir -p "${OUT:-indexer-figures}" && cd "${OUT:-indexer-figures}" && pwd) \
    || fail "cannot make the output folder ${OUT:-indexer-figures}"
export PYTHONUNBUFFERED=1
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$ROOT"/.whl/*.whl || fail "pip install of .whl"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    || fail "torch and triton do not import"
t0=$(date +%s)
mark() { echo "== $1 done at $(( $(date +%s) - t0 )) s"; }

(cd "$HERE" && python3 indexer.py --quick --only prefill \
    --prefill-cases 4096x32768,2048x65536,8192x8192 --variants '' --planar-variants ws 2>&1 \
    | tee "$OUT/indexer.txt")
mark indexer
(cd "$ROOT" && python3 bench/step_gpu.py --layers 4 --kernels flashmla --repeat 3 2>&1 \
    | tee "$OUT/step.txt")
mark step
(cd "$HERE" && python3 indexer.py --only decode --decode-cases 8x131072,64x4096 --variants '' \
    2>&1 | tee "$OUT/decode.txt")
mark decode
if [[ -f "$ROOT/.gpu/deepgemm-src.tar.gz" ]]; then
    tar -xzf "$ROOT/.gpu/deepgemm-src.tar.gz" -C "$ROOT/.gpu" \
        && bash "$HERE/deepgemm_build.sh" 2>&1 | tail -5
    (cd "$HERE" && PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 indexer.py --quick \
        --only prefill --prefill-cases 4096x32768 --variants '' --planar-variants '' \
        --deepgemm 2>&1 | tee "$OUT/deepgemm.txt")
else
    echo "deepgemm: skipped: no .gpu/deepgemm-src.tar.gz (bash bench/deepgemm_stage.sh stages it)" \
        | tee "$OUT/deepgemm.txt"
fi
mark all
