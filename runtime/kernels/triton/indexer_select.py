"""The tiled indexer's exact top-k of rows of int32 keys (``indexer_tiled`` launches it after
the logits; jitted bodies in ``indexer_select_jit``). Figures behind the defaults:
bench/RESULTS.md (``bench/indexer.py``). The launch shapes (``tiles`` below) are an
``indexer_tiled.IndexerTiles``; this module does not import it (``indexer_tiled`` imports this).

Top-k (``_select``), by row shape:

- CUDA rows (at least ``cuda_select_rows`` rows, where ``..cuda.row_topk`` builds and runs:
  a prefill chunk's rows): one CTA a row selects in shared memory (``row_topk.cu``; rows at
  most ``cuda_select_short_keys`` wide take its short rows' build, four CTAs an SM, its result
  sorted by merges unless ``cuda_select_merge`` is off); the
  Triton paths below serve the rest, and every row where it cannot run;
- split path (at most ``split_rows`` rows of at most ``split_run_max`` x ``rank_runs`` keys:
  short decode rows): ``sort_runs_kernel`` sorts runs of composites ``key << 32 | (2**32 - 1 -
  position)`` over many programs, ``rank_runs_kernel`` places each by binary searches in the
  row's other runs (a one-round merge) and writes those placed before K (a row's programs
  launched together, ``rank_row_major``: its outputs are written while they sit in L2);
- filter path (the other rows, where the candidate slots make at most ``rank_runs`` runs):
  ``filter_threshold_kernel`` takes a row's threshold at a rank of a strided sample (found by
  bisection), ``filter_count_kernel`` counts each chunk's keys at or above it,
  ``filter_scatter_kernel`` gathers them in position order into the row's slots
  (``filter_slots``) when the count holds the top K, ``filter_trim_kernel`` keeps a row's exact
  top K in place (more than ``trim_rows`` rows), then the split path's run sorts and ranks;
- segment path (rows whose threshold missed, and shapes the filter path does not take):
  persistent ``select_kernel`` programs over (row, segment) items; per item a sampled threshold
  and one gathering pass (retried at a corrected rank, ``select_attempts``; then an in-kernel
  radix select, exact), the exact top K of the candidates kept (``_keep_top``, when K < CAP)
  and ordered by a merge sort from sorted segments; long rows' segments are merged by ranks,
  or past ``rank_runs`` runs by a second select.

Every path writes every output slot (pads -inf / NO_KEY), so outputs need no fill.
"""

from __future__ import annotations

import math

import torch
import triton

from ..cuda import row_topk
from ..reference.formats import NO_KEY
from . import indexer_select_jit as sjit


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _outputs(T, topk, device, *, fill=True):
    """(scores, ids) ``[T, topk]``: filled with the pads (-inf, NO_KEY), or left empty for
    ``_select``, which writes every slot."""
    if not fill:
        return (torch.empty((T, topk), dtype=torch.float32, device=device),
                torch.empty((T, topk), dtype=torch.int32, device=device))
    top_s = torch.full((T, topk), float("-inf"), dtype=torch.float32, device=device)
    top_i = torch.full((T, topk), NO_KEY, dtype=torch.int32, device=device)
    return top_s, top_i


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores -> the kernels' order-preserving int32 keys (-0.0 as +0.0)."""
    bits = torch.where(scores == 0, 0.0, scores.float()).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _select(keys, lens, topk, top_s, top_i, tiles, *, decode_ids=False, W=1, I=1, rank=0):
    """Exact top-k of each row of int32 keys ``[R, L]`` (row r: its first lens[r] columns)
    into ``top_s`` / ``top_i``, every slot written (pads -inf / NO_KEY): the outputs need no
    fill. The split and filter paths write the pads in their run sorts; the others, whose
    ranks write only the live slots, have the outputs filled first."""
    R, L = keys.shape
    if cuda_rows(R, topk, keys.device, tiles):
        defines = row_topk.select_defines(L, topk, tiles.cuda_select_short_keys,
                                          tiles.cuda_select_merge)
        if defines and row_topk.unavailable_reason(keys.device, defines) is not None:
            defines = ()  # (the short rows' build failed: the default selects them)
        row_topk.select(keys, lens if lens.dtype == torch.int32 else lens.int(), topk, top_s,
                        top_i, decode_ids=decode_ids, W=W, I=I, rank=rank, defines=defines)
        return
    kp = triton.next_power_of_2(topk)
    ids = {"RANK": rank, "W": W, "I": I, "DECODE_IDS": decode_ids}
    split = _split_shape(R, L, tiles)
    if split:  # few short rows: split path
        run, runs = split
        sorted_runs = torch.empty(R, runs * run, dtype=torch.int64, device=keys.device)
        sjit.sort_runs_kernel[(R, runs)](keys, lens, sorted_runs, top_s, top_i, keys.stride(0),
                                         sorted_runs.stride(0), top_s.stride(0), L, topk,
                                         HAS_LEN=True, SEG=run, COMPOSITE_IN=False,
                                         num_warps=tiles.split_warps)
        _rank_launch(sorted_runs, top_s, top_i, topk, run, runs, tiles, ids, lens=lens, n=L)
        return
    sms = _num_sms(keys.device)
    segs = max(1, min(triton.cdiv(tiles.programs_per_sm * sms, R), L // (4 * kp)))
    seg_len = triton.cdiv(triton.cdiv(L, segs), tiles.select_block) * tiles.select_block
    segs = triton.cdiv(L, seg_len)
    common = {**ids, "KP": kp,
              "CAP": triton.next_power_of_2(max(tiles.select_cap, kp)),
              "S": triton.next_power_of_2(max(tiles.select_sample, 16)),
              "ATTEMPTS": tiles.select_attempts if tiles.select_sample else 0,
              "BLOCK": min(tiles.select_block, 1 << 15), "BITS": tiles.radix_bits,
              "num_warps": tiles.select_warps}
    cap = common["CAP"]
    segs_sort = min(triton.next_power_of_2(max(tiles.sort_segments, 1)), cap // 16)
    segs_k = min(triton.next_power_of_2(max(tiles.exact_segments, 1)), max(1, kp // 16))
    common.update(SORT_SEGS=segs_sort, LOG_SEG=(cap // segs_sort).bit_length() - 1,
                  LOG_SEGS=segs_sort.bit_length() - 1, EXACT=kp < cap,
                  SORT_SEGS_K=segs_k, LOG_SEG_K=(kp // segs_k).bit_length() - 1,
                  LOG_SEGS_K=segs_k.bit_length() - 1)
    runs = triton.next_power_of_2(segs)
    skip = None
    if runs <= tiles.rank_runs:
        # the filter path selects the rows it can (and writes every row's pads); the segment
        # path below only the others
        skip = _filter_launch(keys, lens, topk, top_s, top_i, tiles, ids)
    if skip is None:
        top_s.fill_(float("-inf"))
        top_i.fill_(NO_KEY)
    if segs == 1:
        _select_launch(keys, lens, keys, top_s, top_i, L, L, 1, topk, tiles, sms, True, False,
                       common, skip=skip)
        return
    # long rows: each segment's sorted top-K composites (a run of KP), then the row's top-K of
    # the runs: by ranks (runs padded to a power of two) or a second select over them
    cand = torch.full((R, runs * kp), sjit.NO_COMPOSITE, dtype=torch.int64, device=keys.device)
    _select_launch(keys, lens, cand, top_s, top_i, L, seg_len, segs, topk, tiles, sms, True, False,
                   common, final=False, skip=skip)
    if runs <= tiles.rank_runs:
        # a row's runs past its end (segments of no key) are not searched
        _rank_launch(cand, top_s, top_i, topk, kp, runs, tiles, ids, skip=skip, lens=lens, n=L,
                     run_keys=seg_len)
        return
    n = segs * kp
    _select_launch(cand, lens, cand, top_s, top_i, n, n, 1, topk, tiles, sms, False, True, common)


def cuda_rows(R: int, topk: int, device, tiles) -> bool:
    """Whether R rows of top-``topk`` take the CUDA row kernel (``..cuda.row_topk``)."""
    return (tiles.cuda_select and R >= tiles.cuda_select_rows and topk <= row_topk.MAX_TOPK
            and device.type == "cuda" and row_topk.unavailable_reason(device) is None)


def _split_shape(R: int, L: int, tiles) -> tuple[int, int] | None:
    """(run, runs) of the split path for R rows of L keys, or None where it does not apply."""
    run = max(triton.next_power_of_2(tiles.split_run),
              min(triton.next_power_of_2(triton.cdiv(L, max(1, tiles.split_runs))),
                  triton.next_power_of_2(tiles.split_run_max)))
    runs = triton.next_power_of_2(triton.cdiv(L, run))
    return (run, runs) if R <= tiles.split_rows and runs <= tiles.rank_runs else None


def _rank_launch(sorted_runs, top_s, top_i, topk, run, runs, tiles, ids, *, lens=None, n=0,
                 skip=None, run_keys=None, chunk=0):
    """Top-k of each row's ``runs`` sorted runs of ``run`` composites, placed by ranks; with
    ``lens``, runs past a row's first min(lens[r], n) keys are pads, not searched; rows whose
    ``skip`` flag is set are left alone. ``chunk``: composites a program (0: rank_chunk)."""
    chunk = min(run, triton.next_power_of_2(chunk or tiles.rank_chunk))
    R = sorted_runs.shape[0]
    # one program a (row, run, chunk), in one dimension (rows may pass the grid's 65535)
    sjit.rank_runs_kernel[(R * runs * (run // chunk),)](
        sorted_runs, lens if lens is not None else sorted_runs,
        skip if skip is not None else sorted_runs, top_s, top_i, sorted_runs.stride(0),
        top_s.stride(0), n, runs, run if run_keys is None else run_keys, topk,
        HAS_LEN=lens is not None, SEG=run, LOG_SEG=run.bit_length() - 1,
        RUNS=triton.next_power_of_2(tiles.rank_runs), CHUNK=chunk, HAS_SKIP=skip is not None,
        ROW_MAJOR=tiles.rank_row_major, num_warps=tiles.rank_warps, **ids)


def _select_launch(src, lens, dst, top_s, top_i, n, seg_len, segs, topk, tiles, sms, has_len,
                   composite, common, *, final=True, skip=None):
    items = src.shape[0] * segs
    # after the filter path (skip flags) most programs read their flags and end: one wave
    # (a 16-warp program fills a SM's registers: no fewer programs at a time either way)
    progs = max(1, min(items, (1 if skip is not None else tiles.select_programs_per_sm) * sms))
    buf = torch.empty(progs, common["CAP"] + common["KP"], dtype=torch.int64, device=src.device)
    sjit.select_kernel[(progs,)](src, lens, skip if skip is not None else lens, buf, dst, top_s,
                                top_i, src.stride(0), dst.stride(0), top_s.stride(0), n, seg_len,
                                segs, items, topk, common["RANK"], float(tiles.select_margin),
                                HAS_LEN=has_len, HAS_SKIP=skip is not None,
                                COMPOSITE_IN=composite, FINAL=final,
                                **{k: v for k, v in common.items() if k != "RANK"})


def filter_slots(L: int, topk: int, tiles) -> int:
    """Candidate slots per row of the filter path: ``filter_cap``, or (0) the least power of
    two >= 1.5 x the candidates a row of L keys is expected to pass, topk + margin x
    sqrt(topk x L / S) + L / S for S samples (the threshold's sample rank m + margin x sqrt(m),
    m = topk x S / L; shorter rows pass fewer). With 1.25 x, rows with ties at the threshold
    overflowed into the segment path (bench/RESULTS.md)."""
    if tiles.filter_cap:
        return triton.next_power_of_2(max(tiles.filter_cap, topk))
    S = triton.next_power_of_2(max(tiles.filter_sample, 16))
    want = topk + tiles.filter_margin * math.sqrt(topk * L / S) + L / S
    return triton.next_power_of_2(max(topk, int(1.5 * want)))


def _filter_launch(keys, lens, topk, top_s, top_i, tiles, ids) -> torch.Tensor:
    """The filter path: every row's keys at or above a sampled threshold (one program a row),
    counted by ``filter_chunk``-key chunks, then gathered in position order into the row's
    candidate slots (``filter_slots``; ``filter_scatter_kernel``), then sorted in place as runs
    and placed by ranks as the split path does; all output pads written. Rows go in batches
    whose slots fit ``filter_budget_bytes``. A row whose threshold missed (fewer than min(K,
    live keys) or more than the slots above it) gets no candidates. Returns the rows' ok flags
    ``[R]`` int32, the skip flags of the segment path that then selects the other rows; None
    (nothing launched) where the slots would make more runs than ``rank_runs``."""
    R, L = keys.shape
    ch = triton.next_power_of_2(tiles.filter_chunk)
    C = triton.cdiv(L, ch)
    cap = filter_slots(L, topk, tiles)
    run = min(triton.next_power_of_2(tiles.split_run), cap)
    if cap // run > tiles.rank_runs:
        return None
    dev = keys.device
    # rows in batches whose candidate slots fit filter_budget_bytes (a chunk of many short
    # prefill rows would otherwise take twice its logits' bytes)
    batch = min(R, max(1, tiles.filter_budget_bytes // (8 * cap)))
    ok = torch.empty(R, dtype=torch.int32, device=dev)
    thr = torch.empty(batch, dtype=torch.int32, device=dev)
    cnt_buf = torch.empty(2 * batch * C, dtype=torch.int32, device=dev)
    cand = torch.empty(batch, cap, dtype=torch.int64, device=dev)
    cand_len = torch.empty(batch, dtype=torch.int32, device=dev)
    trim = R > tiles.trim_rows
    # a trimmed row holds at most topk candidates: the run sorts and ranks launch only the
    # runs that can hold them, not the slots' (8192 slots at L 32k: 4 runs of 512, not 16)
    runs = min(cap // run, triton.cdiv(topk, run)) if trim else cap // run
    sms = _num_sms(dev)
    for r0 in range(0, R, batch):
        n = min(R, r0 + batch) - r0
        # chunks a counting / gathering program: filter_group where that leaves at least
        # filter_group_programs a SM (a prefill's rows), else 1 (a few long decode rows);
        # two values at most, so two compiles of each kernel
        g = tiles.filter_group
        if g < 1 or n * C < g * tiles.filter_group_programs * sms:
            g = 1
        cg = triton.cdiv(C, g)
        k, ln, s, i = keys[r0:r0 + n], lens[r0:r0 + n], top_s[r0:r0 + n], top_i[r0:r0 + n]
        cnt = cnt_buf[:2 * n * C].view(2, n, C)
        sjit.filter_threshold_kernel[(n,)](k, ln, thr, k.stride(0), L, topk,
                                           float(tiles.filter_margin), CAP=cap,
                                           S=triton.next_power_of_2(max(tiles.filter_sample, 16)),
                                           num_warps=tiles.filter_warps)
        sjit.filter_count_kernel[(n, cg)](k, ln, thr, cnt, k.stride(0), L, C, CH=ch, G=g,
                                          num_warps=tiles.split_warps)
        sjit.filter_scatter_kernel[(n, cg)](k, ln, thr, cnt, cand, cand_len, ok[r0:r0 + n],
                                            k.stride(0), cand.stride(0), L, topk, C, CAP=cap,
                                            CH=ch, CB=triton.next_power_of_2(C), G=g,
                                            num_warps=tiles.filter_scatter_warps)
        if trim:
            sjit.filter_trim_kernel[(n,)](cand, cand_len, cand.stride(0), topk, CAP=cap,
                                          BLK=min(cap, 1024),
                                          THREE_Q=cap >= 64,  # slots of CAP / 4 + CAP / 8
                                          RADIX=tiles.trim_radix_bits,
                                          num_warps=tiles.trim_warps)
        # in place: each run's program reads its run before it writes it back sorted
        sjit.sort_runs_kernel[(n, runs)](cand, cand_len, cand, s, i, cand.stride(0),
                                         cand.stride(0), s.stride(0), cap, topk,
                                         HAS_LEN=True, SEG=run, COMPOSITE_IN=True,
                                         num_warps=tiles.filter_sort_warps)
        _rank_launch(cand[:n], s, i, topk, run, runs, tiles, ids, lens=cand_len, n=cap,
                     chunk=tiles.filter_rank_chunk)
    return ok
