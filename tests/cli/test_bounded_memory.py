"""Issue 31 item 6: every command's memory and time follow a documented cap, not the token
counts a plan names. `inspect` of a plan whose decodes hold 2**31 tokens costs what a small
plan does (the cost model sums closed forms per request); `inspect` text shows at most
MAX_ROWS_SHOWN rows a table; `replay` refuses, exit 2 and one line, a plan one process cannot
hold, before allocating anything.

Memory is bounded with tracemalloc (numpy's buffers are traced) in-process, and with an address
space limit (RLIMIT_AS) on a real process for replay, whose tensors tracemalloc cannot see.
"""

import json
import resource
import subprocess
import sys
import tracemalloc

import pytest

from cpplan.cli.inspect_cmd import MAX_ROWS_SHOWN
from cpplan.planner import compile as compile_plan
from cpplan.schemas import ParallelConfig, StepInput, encode_plan
from tests.cli.inprocess import run_cli
from tests.cli.test_cli import ENV, ROOT

INSPECT_PEAK_BYTES = 64 << 20  # traced peak of one inspect of a one-request or 8k-request plan
SECONDS = 20


def _write(tmp_path, name, config, c, q, pre):
    step = StepInput.build(1, [f"r{i}" for i in range(len(c))], c, q, pre)
    path = tmp_path / f"{name}.msgpack"
    path.write_bytes(encode_plan(compile_plan(config, step)))
    return path


def _traced(*argv):
    # one untraced run first: a cold numba cache (a fresh clone) compiles the planner's and the
    # codec's kernels on first use, ~15 s under tracemalloc; the bounds are on inspect's work
    run_cli(*argv)
    tracemalloc.start()
    try:
        result = run_cli(*argv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak


def _cost(result):
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout)["cost"]


def _tri(n):
    return n * (n + 1) // 2


def _capped(n, cap):  # sum_{m=1..n} min(m, cap), Python ints
    return _tri(n) if n <= cap else _tri(cap) + (n - cap) * cap


# ---------------------------------------------------------------- inspect: the cost model
def test_inspect_one_decode_of_q_near_2_31(tmp_path):
    q = 2**31 - 100
    plan = _write(tmp_path, "bigq", ParallelConfig(max_model_len=2**31 - 1), [0], [q], [False])
    text, peak = _traced("inspect", plan)
    assert text.code == 0 and "Traceback" not in text.stderr, text.stderr
    assert peak < INSPECT_PEAK_BYTES, f"{peak:,} bytes traced"  # before: 16 GiB asked for
    assert text.seconds < SECONDS
    cost = _cost(run_cli("inspect", plan, "--json"))
    assert cost["indexer_keys"] == [_tri(q)]  # n = 1 .. q
    assert cost["attention_keys"] == [_capped(q, 2048)]


def test_inspect_8000_decodes_of_q_65536(tmp_path):
    n, q = 8000, 65536
    plan = _write(tmp_path, "many", ParallelConfig(), [0] * n, [q] * n, [False] * n)
    text, peak = _traced("inspect", plan)
    assert text.code == 0 and "Traceback" not in text.stderr, text.stderr
    assert peak < INSPECT_PEAK_BYTES, f"{peak:,} bytes traced"  # before: 4 GiB asked for
    assert text.seconds < SECONDS
    cost = _cost(run_cli("inspect", plan, "--json"))
    assert cost["indexer_keys"] == [n * _tri(q)]
    assert cost["attention_keys"] == [n * _capped(q, 2048)]


def _rank_keys(x, w, r):
    """sum_{n=1..x} (keys of [0, n) on DCP rank r), interleave 1: rank r holds t = r, r + w,
    ...; each such t < x is counted by every n in (t, x]."""
    m = (x - r + w - 1) // w if x > r else 0
    return m * x - (m * r + w * m * (m - 1) // 2)


def test_inspect_dcp_decode_near_2_31_per_rank(tmp_path):
    # W = 4: per-rank closed forms; past top-k the walk is over MAX_WALKED_TOKENS, so each
    # request's last token's share stands for the others (documented estimate)
    w, c, q = 4, 1000, 2**31 - 2000
    cfg = ParallelConfig(dcp_size=w, max_model_len=2**31 - 8)
    plan = _write(tmp_path, "dcp", cfg, [c], [q], [False])
    text, peak = _traced("inspect", plan)
    assert text.code == 0 and peak < INSPECT_PEAK_BYTES, (text.stderr, peak)
    cost = _cost(run_cli("inspect", plan, "--json"))
    b = c + q
    assert cost["indexer_keys"] == [_rank_keys(b, w, r) - _rank_keys(c, w, r) for r in range(w)]
    assert sum(cost["indexer_keys"]) == _tri(b) - _tri(c)
    # every token past top-k attends 2048 keys, spread over the ranks: within 1 key a token
    over = b - 2048
    assert abs(sum(cost["attention_keys"]) - (_capped(b, 2048) - _capped(c, 2048))) <= w * over


def test_inspect_text_shows_at_most_64_rows_a_table(tmp_path):
    # 4,000 prefills of 3 tokens, 256-token model: ~2,000 gather chunks, ~4,000 collectives
    n = 4000
    cfg = ParallelConfig(pcp_size=2, dcp_size=2, max_model_len=256)
    plan = _write(tmp_path, "chunks", cfg, [100] * n, [3] * n, [True] * n)
    result = run_cli("inspect", plan)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    # six tables (requests, 2 ranks, chunks, collectives, cost) of <= 64 rows + headers
    assert len(lines) <= 6 * (MAX_ROWS_SHOWN + 8) + 10, len(lines)  # before: ~12,000 lines
    assert "more gather chunks (--json shows all)" in result.stdout
    assert "more collectives (--json shows all)" in result.stdout
    full = json.loads(run_cli("inspect", plan, "--json").stdout)
    assert len(full["gather_chunks"]) > 1000 and len(full["collectives"]) > 2000


# ---------------------------------------------------------------- replay: refused up front
SIM = dict(block_size=64, num_heads=8, topk=64, index_num_heads=4, index_head_dim=128,
           activation_dtype="float32")


def _sim_config(p, w, max_model_len=4096, layers=2):
    return ParallelConfig(pcp_size=p, dcp_size=w, num_layers=layers,
                          hidden_size=layers * 8 * 512, max_model_len=max_model_len, **SIM)


REPLAY_AS_BYTES = 4 << 30  # the address space a refused replay runs in (torch's import fits)


def _limited(cmd):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (REPLAY_AS_BYTES, REPLAY_AS_BYTES))
    return subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          preexec_fn=limit)


@pytest.mark.parametrize("name, config, c, q, words", [
    # before: 1.4 TB asked for by the layer cache, exit 1 with a traceback
    ("context_2_31", _sim_config(1, 1, 2**31 - 1), [2**31 - 10], [1],
     "at most 32,768 tokens (sum of c + q): got 2,147,483,639"),
    # before: gigabytes per rank thread, out of memory, exit 1
    ("p64w64", _sim_config(64, 64), [100, 0], [1, 200], "at most 8 ranks: got 64 (P=64, W=64)"),
    ("scores", _sim_config(1, 1, 32768), [0], [32000], "oracle scores"),
])
def test_replay_refuses_oversized_plans_up_front(tmp_path, name, config, c, q, words):
    pre = [x == 0 for x in c]
    plan = _write(tmp_path, name, config, c, q, pre)
    proc = _limited([sys.executable, "-m", "cpplan", "replay", str(plan)])
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
