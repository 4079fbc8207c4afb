"""The native prefill path (`tokenops::paged_prefill_attention`) equals paged_attention's PyTorch path
(gather + SDPA with an explicit mask, or SDPA on a first chunk's own keys): query chunks on cached
prefixes through random non-contiguous block tables, several block sizes and GQA ratios, ragged
batches mixing decodes and prefill chunks in any order (some chunks left to SDPA), every KV dtype
incl. int8, bfloat16 queries, windows, evicted gaps, head dims 64 / 256 / 8 (no AVX-512 path), 1
and 3 threads; and whole engines generate the same greedy tokens with the kernels on and off.
Where the build has AVX512-BF16, chunks of at least `DOT_MIN_QUERIES` queries over a bf16 cache take
the bf16 dot-product path (queries and softmax weights rounded to bf16): those rows are held to bf16
tolerances, and to a float64 reference on bf16-valued queries."""

from __future__ import annotations

import pytest
import torch

from tokenops.engine import attention, kernels
from tokenops.engine.attention import paged_attention
from tokenops.engine.config import EngineConfig
from tokenops.engine.context import build_context
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.sampling_params import SamplingParams

from .conftest import BF16_DOT_MIN_QUERIES as DOT_MIN_QUERIES
from .conftest import random_kv_cache


@pytest.fixture(autouse=True)
def inference_mode():
    """As the engine runs its model: under autograd, attention takes the torch ops."""
    with torch.inference_mode():
        yield


def attend_both_ways(
    monkeypatch,
    seqs,
    block_size=4,
    heads=9,
    kv_heads=3,
    kv_dtype=torch.float32,
    d=64,
    q_dtype=torch.float32,
    window=None,
    gaps=None,
    seed=0,
    torch_q_dtype=None,
    q_values=None,
):
    """One step for sequences `seqs` = [(absolute length after the step, new tokens)], their prefixes
    already cached (random keys), gaps: evicted (start, length) each. -> (native, PyTorch) outputs and
    the native step's plan. `torch_q_dtype`: run the PyTorch path on q, k, v cast to it; `q_values`:
    queries rounded to this dtype's values (kept in q_dtype)."""
    g = torch.Generator().manual_seed(seed)
    kept = [n - (gaps[s][1] if gaps else 0) for s, (n, _) in enumerate(seqs)]
    need = sum(-(-n // block_size) for n in kept)
    num_blocks = need + 8
    caches = random_kv_cache(num_blocks, block_size, kv_heads, d, kv_dtype, g)
    free = torch.randperm(num_blocks, generator=g).tolist()  # random, non-contiguous blocks
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in kept]
    t = sum(n for _, n in seqs)
    q = torch.randn(t, heads, d, generator=g) * 2
    q = (q if q_values is None else q.to(q_values)).to(q_dtype)
    k = torch.randn(t, kv_heads, d, generator=g).to(q_dtype)
    v = torch.randn(t, kv_heads, d, generator=g).to(q_dtype)
    outs, plans = [], []
    for flag in ("1", "0"):
        monkeypatch.setattr(kernels, "enabled", flag == "1")
        ctx = build_context(
            [n for _, n in seqs], [n for n, _ in seqs], tables, block_size, caches, kv_gaps=gaps
        )
        cast = torch_q_dtype if flag == "0" and torch_q_dtype else q_dtype
        outs.append(paged_attention(q.to(cast), k.to(cast), v.to(cast), ctx, 0, d**-0.5, window))
        plans.append(ctx.attn_plan)
    assert plans[1].native is None
    return outs[0], outs[1], plans[0]


def bf16_dot(native, kv_dtype, seqs) -> bool:
    """Whether the kernel attends some of these chunks with bf16 dot products."""
    return (
        kv_dtype == torch.bfloat16
        and native.prefill_bf16_dot()
        and any(n >= DOT_MIN_QUERIES for _, n in seqs)
    )


def assert_close(native_out, torch_out, kv_dtype=torch.float32, dot=False):
    # both paths read the cache's values (a first chunk's own keys rounded to a half cache's dtype
    # as well) and compute in float32: only the order of the sums differs, whatever the KV dtype;
    # `dot`: the bf16 dot-product path attended some rows (queries and weights rounded to bf16)
    tol = dict(atol=2e-2, rtol=2e-2) if dot else dict(atol=3e-5, rtol=3e-5)
    assert native_out.dtype == torch_out.dtype and native_out.shape == torch_out.shape
    torch.testing.assert_close(native_out, torch_out, **tol)


def test_cached_prefix_chunk_takes_the_kernel(native, monkeypatch):
    got, ref, plan = attend_both_ways(monkeypatch, [(1016, 16)])
    assert plan.native is not None and plan.native_rows is None and not plan.prefills
    assert_close(got, ref)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize(
    "seqs",
    [
        [(300, 40)],  # a chunk on a prefix
        [(40, 40)],  # a first chunk
        [(5, 1), (70, 33), (1, 1), (200, 17), (16, 16), (17, 2)],  # decodes and chunks mixed, ragged
    ],
)
def test_float32_equals_torch_path(native, monkeypatch, block_size, heads, kv_heads, seqs):
    got, ref, plan = attend_both_ways(monkeypatch, seqs, block_size, heads, kv_heads)
    assert not plan.prefills  # every sequence went to the kernel
    assert_close(got, ref)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("seqs", [[(257, 100)], [(3, 3), (90, 1), (41, 30), (12, 5)]])
def test_every_kv_dtype(native, monkeypatch, kv_dtype, seqs):
    # a first chunk's PyTorch path attends to its own keys rounded to the cache dtype, the kernel
    # reads them back
    got, ref, _ = attend_both_ways(monkeypatch, seqs, 16, 9, 3, kv_dtype, seed=len(seqs))
    assert_close(got, ref, kv_dtype, bf16_dot(native, kv_dtype, seqs))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_bfloat16_queries(native, monkeypatch, kv_dtype):
    # the kernel computes in float32 whatever the query dtype (or the 64-query chunk in bf16 dot
    # products, on bfloat16 queries the same values): it equals the float32 PyTorch path on the same
    # bfloat16 values, rounded to bfloat16
    got, ref, _ = attend_both_ways(
        monkeypatch,
        [(130, 20), (7, 1), (64, 64)],
        16,
        9,
        3,
        kv_dtype,
        q_dtype=torch.bfloat16,
        torch_q_dtype=torch.float32,
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("window", [1, 5, 64, 1000])
@pytest.mark.parametrize("seqs", [[(300, 50)], [(4, 4), (70, 9), (1, 1), (150, 100)]])
def test_sliding_window(native, monkeypatch, window, seqs):
    got, ref, _ = attend_both_ways(monkeypatch, seqs, 4, 8, 2, window=window, seed=window)
    assert_close(got, ref)


@pytest.mark.parametrize("window", [None, 3, 20, 40, 200])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_evicted_gaps(native, monkeypatch, window, kv_dtype):
    # gaps of whole blocks before the chunk; windows ending before, across and after the gap; a
    # sequence without a gap; a decode with one
    seqs, gaps = [(300, 30), (60, 1), (45, 12), (12, 3)], [(16, 128), (8, 24), (0, 0), (4, 4)]
    got, ref, _ = attend_both_ways(monkeypatch, seqs, 4, 9, 3, kv_dtype, window=window, gaps=gaps)
    assert_close(got, ref)


@pytest.mark.parametrize(
    ("d", "heads", "kv_heads", "window"), [(256, 4, 1, 512), (256, 4, 1, None), (8, 4, 2, 6)]
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_head_dims(native, monkeypatch, d, heads, kv_heads, window, kv_dtype):
    # Gemma 3 270M's shape (head_dim 256, one KV head, window 512), and head_dim 8: the plain loops
    seqs = [(1100, 64), (600, 1), (20, 20)]
    got, ref, _ = attend_both_ways(monkeypatch, seqs, 16, heads, kv_heads, kv_dtype, d=d, window=window)
    assert_close(got, ref, kv_dtype, bf16_dot(native, kv_dtype, seqs) and d % 64 == 0)


def test_build_has_the_bf16_dot_path_where_the_cpu_does(native):
    """Compiled in by the native build on a CPU with AVX512-BF16, never by the AVX2 or plain AVX-512
    targets (x86-64-v3 / v4 do not include it)."""
    cpu_bf16 = "avx512_bf16" in open("/proc/cpuinfo").read()
    assert native.prefill_bf16_dot() == (cpu_bf16 and kernels.kernel_isa() == "native")


def test_build_has_the_bf16_tiles_where_the_cpu_does(native):
    """The bf16 dot path multiplies on AMX's tiles where the native build's CPU has AMX-BF16, and
    can be switched back to vdpbf16ps; other builds never have them."""
    cpu = open("/proc/cpuinfo").read()
    built = "amx_bf16" in cpu and "amx_tile" in cpu and kernels.kernel_isa() == "native"
    assert native.prefill_bf16_amx() == built
    before = native.set_prefill_bf16_amx(False)
    try:
        assert before == built and not native.prefill_bf16_amx()
    finally:
        native.set_prefill_bf16_amx(True)
    assert native.prefill_bf16_amx() == built


def test_tiles_and_vdpbf16ps_agree_to_bf16_rounding(native):
    """The same chunks on AMX's tiles and on vdpbf16ps: both sum bf16 pair products in float32 (the
    tiles over up to 128 keys per softmax step), so they differ by the weights' bf16 rounding and the
    sums' order, not more; a first chunk, one on a long prefix, and one whose rows are not whole tiles."""
    if not native.prefill_bf16_amx():
        pytest.skip("the kernel has no AMX tiles on this CPU or build")
    g = torch.Generator().manual_seed(11)
    bs, kv_heads, heads, d = 16, 3, 9, 64
    seqs = [(300, 300), (1500, 40), (77, 37)]  # (kept keys, queries)
    k_cache, v_cache = random_kv_cache(
        sum(-(-n // bs) for n, _ in seqs) + 2, bs, kv_heads, d, torch.bfloat16, g
    )[0]
    nb = max(-(-n // bs) for n, _ in seqs)
    free = torch.randperm(k_cache.shape[0], generator=g).tolist()
    tables = torch.zeros(len(seqs), nb, dtype=torch.long)  # entries past a sequence's blocks unread
    for i, (n, _) in enumerate(seqs):
        tables[i, : -(-n // bs)] = torch.tensor([free.pop() for _ in range(-(-n // bs))])
    t = sum(n for _, n in seqs)
    q = torch.randn(t, heads, d, generator=g)
    starts = torch.tensor([0, 300, 340])
    args = (
        None,
        None,
        tables,
        starts,
        torch.tensor([n for _, n in seqs]),
        torch.tensor([n for n, _ in seqs]),
    )
    outs = []
    for tiles in (True, False):
        native.set_prefill_bf16_amx(tiles)
        try:
            outs.append(native.paged_prefill_attention(q, k_cache, v_cache, *args, None, 0, d**-0.5))
        finally:
            native.set_prefill_bf16_amx(True)
    assert not torch.equal(outs[0], outs[1])  # two paths ran
    torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=1e-2)


@pytest.fixture(params=["tiles", "vdpbf16ps"])
def dot_products(request, native):
    """The bf16 dot path on AMX's tiles (where built; else skipped) or on vdpbf16ps."""
    tiles = request.param == "tiles"
    if tiles and not native.prefill_bf16_amx():
        pytest.skip("the kernel has no AMX tiles on this CPU or build")
    before = native.set_prefill_bf16_amx(tiles)
    yield request.param
    native.set_prefill_bf16_amx(before)


@pytest.mark.parametrize(
    ("seqs", "heads", "kv_heads", "d", "block_size", "window", "gaps"),
    [
        ([(1000, 488)], 9, 3, 64, 16, None, None),  # the second chunk of a cold 1,000-token prompt
        ([(100, 100)], 9, 3, 64, 4, None, None),  # a first chunk, ragged against the 16-token tiles
        # decodes, short chunks (exact path) and long ones (dot path) mixed, chunks after prefixes
        ([(5, 1), (300, 40), (64, 64), (17, 2), (90, 33), (61, 31), (250, 97)], 9, 3, 64, 4, None, None),
        ([(700, 70)], 4, 1, 128, 16, None, None),
        ([(1100, 64), (20, 20)], 4, 1, 256, 16, 512, None),  # Gemma 3 270M's shape and window
        ([(300, 50), (150, 100)], 8, 2, 64, 4, 37, None),  # a window inside the chunk
        ([(300, 60), (45, 40)], 9, 3, 64, 4, 20, [(16, 128), (0, 0)]),  # an evicted gap before the chunk
        ([(300, 60)], 9, 3, 64, 4, None, [(16, 128)]),
        ([(200, 40)], 33, 1, 64, 16, None, None),  # a group of 33 heads: one token per tile
    ],
)
def test_bf16_dot_path_against_float64(
    native, monkeypatch, dot_products, seqs, heads, kv_heads, d, block_size, window, gaps
):
    # on bfloat16-valued queries only the softmax weights' rounding to bf16 (and the order of the
    # sums) separates the kernel from float64 attention over the same cache; random non-contiguous
    # block tables. With AMX and a kernel without the tiles (the vdpbf16ps case) the engine sends
    # chunks this long to SDPA instead: held to the kernel here
    monkeypatch.setattr(attention, "has_bf16_tiles", lambda device: False)
    got, ref, plan = attend_both_ways(
        monkeypatch,
        seqs,
        block_size,
        heads,
        kv_heads,
        torch.bfloat16,
        d=d,
        window=window,
        gaps=gaps,
        torch_q_dtype=torch.float64,
        q_values=torch.bfloat16,
    )
    assert plan.native is not None and not plan.prefills
    torch.testing.assert_close(got.double(), ref, atol=1e-2, rtol=1e-2)
    # rows of chunks shorter than DOT_MIN_QUERIES (decodes among them) stay on the exact path
    row = 0
    for _, n in seqs:
        if n < DOT_MIN_QUERIES:
            torch.testing.assert_close(got[row : row + n].double(), ref[row : row + n], atol=3e-5, rtol=3e-5)
        row += n


def test_window_reads_no_block_before_its_first(native):
    """Blocks wholly before every query's window may have left the sequence (their table entries
    stale or out of range): the kernel reads none of them, whatever the path (the bf16 dot path packs
    keys in blocks of 32, which here start before the window's first block of 4)."""
    g = torch.Generator().manual_seed(3)
    bs, kv_heads, heads, d, length, n, window = 4, 3, 9, 64, 300, 64, 58
    for dtype in (torch.bfloat16, torch.float32):
        k_cache, v_cache = random_kv_cache(length // bs + 4, bs, kv_heads, d, dtype, g)[0]
        table = torch.randperm(length // bs + 4, generator=g)[: length // bs][None].contiguous()
        q = torch.randn(n, heads, d, generator=g)
        args = (torch.tensor([0]), torch.tensor([n]), torch.tensor([length]), None, window, d**-0.5)
        want = native.paged_prefill_attention(q, k_cache, v_cache, None, None, table, *args)
        first = (length - n + 1 - window) // bs  # the first block the first query's window reaches
        stale = table.clone()
        stale[0, :first] = 1 << 40
        got = native.paged_prefill_attention(q, k_cache, v_cache, None, None, stale, *args)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_bf16_dot_path_threads_and_split_keys(native, monkeypatch, dot_products):
    # one tile on a long prefix with one kv head: its keys split into chunks merged afterwards; held
    # to the kernel as in the float64 test above (without its tiles the engine would hand these to SDPA)
    monkeypatch.setattr(attention, "has_bf16_tiles", lambda device: False)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for seqs, heads, kv_heads in (([(4500, 32)], 4, 1), ([(1500, 300)], 9, 3)):
                got, ref, plan = attend_both_ways(
                    monkeypatch,
                    seqs,
                    16,
                    heads,
                    kv_heads,
                    torch.bfloat16,
                    torch_q_dtype=torch.float64,
                    q_values=torch.bfloat16,
                )
                assert plan.native is not None and not plan.prefills
                torch.testing.assert_close(got.double(), ref, atol=1e-2, rtol=1e-2)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("n", "cached"), [(32, 0), (600, 0), (2048, 0), (32, 1000), (700, 3000), (5, 0)])
def test_every_prefill_chunk_is_native_where_the_kernel_has_tiles(n, cached):
    """Where the kernel's bf16 dot path runs on AMX's tiles, no chunk goes to SDPA: first chunks past
    NATIVE_FIRST_CHUNK_MAX and chunks over a prefix included (pure routing: every CPU)."""
    assert attention._prefill_native(n, cached, quantized=False, bf16_sdpa=True, kernel_tiles=True)
    # without the tiles, bf16 SDPA takes the long ones on a CPU with AMX
    sdpa = n >= (attention.BF16_SDPA_MIN_QUERIES_CACHED if cached else attention.BF16_SDPA_MIN_QUERIES)
    assert attention._prefill_native(n, cached, quantized=False, bf16_sdpa=True) == (not sdpa)


def test_long_first_chunk_left_to_sdpa_beside_kernel_rows(native, monkeypatch):
    # a first chunk over the threshold goes to SDPA; the others (a decode after it, a chunk on a prefix)
    # to the kernel, whose rows are then not a leading slice
    big = attention.NATIVE_FIRST_CHUNK_MAX + 20
    seqs = [(big, big), (50, 1), (80, 16)]
    got, ref, plan = attend_both_ways(monkeypatch, seqs)
    assert len(plan.prefills) == 1 and plan.prefills[0].num_queries == big
    assert isinstance(plan.native_rows, torch.Tensor) and plan.native_rows.numel() == 17
    assert_close(got, ref)


def test_single_thread_and_many(native, monkeypatch):
    # enough work for the thread pool: one short chunk on a long prefix with one KV head (its keys split
    # into chunks merged afterwards), a long chunk, and a batch
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for seqs, heads, kv_heads in (
                ([(4500, 8)], 4, 1),
                ([(1500, 300)], 9, 3),
                ([(1500, 20), (700, 1), (3000, 64)], 8, 2),
            ):
                got, ref, _ = attend_both_ways(monkeypatch, seqs, 16, heads, kv_heads)
                assert_close(got, ref)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("heads", [33, 40, 64])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_more_query_heads_per_kv_head_than_a_tile_holds(native, monkeypatch, heads, kv_dtype):
    """A tile holds 32 query rows; one kv head serving more query heads makes a one-token tile of
    `heads` rows (the per-row buffers overflowed and the process died before they were sized for it)."""
    got, ref, plan = attend_both_ways(
        monkeypatch, [(20, 20), (57, 1), (130, 9)], 16, heads, 1, kv_dtype, d=64
    )
    assert plan.native is not None and not plan.prefills
    assert_close(got, ref, kv_dtype)


def test_a_float64_cache_takes_the_torch_path(native, monkeypatch):
    """The kernel reads float32 / bf16 / f16 / int8 caches: a float64 one (a float64 model) is attended
    by the PyTorch path, and the op itself refuses it rather than reading its bytes as another type."""
    got, ref, plan = attend_both_ways(
        monkeypatch, [(20, 20), (41, 1)], 4, 8, 2, torch.float64, q_dtype=torch.float64
    )
    assert plan.native is None
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    cache = torch.zeros(4, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="caches must be float32, bfloat16, float16 or int8"):
        native.paged_decode_attention(
            torch.zeros(1, 2, 8),
            cache,
            cache,
            None,
            None,
            torch.tensor([[0]]),
            torch.tensor([1]),
            None,
            0,
            1.0,
        )


def test_refuses_bad_query_rows(native):
    cache = torch.zeros(4, 4, 1, 8)
    table, one = torch.tensor([[0, 1]]), torch.tensor([1])
    with pytest.raises(RuntimeError, match="query rows out of range"):  # 3 queries in a 2-row q
        native.paged_prefill_attention(
            torch.zeros(2, 2, 8),
            cache,
            cache,
            None,
            None,
            table,
            torch.tensor([0]),
            torch.tensor([3]),
            torch.tensor([6]),
            None,
            0,
            1.0,
        )
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        native.paged_prefill_attention(
            torch.zeros(1, 2, 8),
            cache,
            cache,
            None,
            None,
            table,
            torch.tensor([0]),
            one,
            torch.tensor([9]),
            None,
            0,
            1.0,
        )
    two = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(RuntimeError, match="overlap or are out of order"):  # both sequences claim row 0
        native.paged_prefill_attention(
            torch.zeros(2, 2, 8),
            cache,
            cache,
            None,
            None,
            two,
            torch.tensor([0, 0]),
            torch.tensor([2, 1]),
            torch.tensor([4, 4]),
            None,
            0,
            1.0,
        )
    with pytest.raises(RuntimeError, match="gap starts and lengths must be >= 0"):
        native.paged_prefill_attention(
            torch.zeros(1, 2, 8),
            cache,
            cache,
            None,
            None,
            table,
            torch.tensor([0]),
            one,
            torch.tensor([4]),
            torch.tensor([[-4, 0]]),
            8,
            1.0,
        )


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma3"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_greedy_equal_with_kernels_on_and_off(native, monkeypatch, request, model, kv_cache_dtype):
    # prefix-cache hits (chunks on a cached prefix), chunked prefill (budget 7) and mixed batches
    tiny = request.getfixturevalue(model)
    g = torch.Generator().manual_seed(21)
    shared = torch.randint(3, 256, (24,), generator=g).tolist()
    ps = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 1)]
    ps.append(torch.randint(3, 256, (30,), generator=g).tolist())
    results = []
    for flag in (True, False):
        monkeypatch.setattr(kernels, "enabled", flag)
        out = []
        for budget in (512, 7):
            engine = LLMEngine(
                tiny.model,
                EngineConfig(
                    num_kv_blocks=96,
                    block_size=4,
                    max_num_batched_tokens=budget,
                    kv_cache_dtype=kv_cache_dtype,
                ),
            )
            out.append(engine.generate(ps[:1], GREEDY))  # caches the shared prefix
            out.append(engine.generate(ps, GREEDY))
        results.append(out)
    assert results[0] == results[1]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [[(40, 1), (70, 1), (9, 1)], [(300, 50), (12, 12), (65, 1)]])
def test_queries_read_in_place_from_the_fused_projection(native, kv_dtype, seqs):
    """The one-call layer hands the kernel q as the first heads of each q|k|v row: the kernel reads
    them where they lie, the same bits as from a contiguous copy, for decode rows and prefill chunks."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    need = sum(-(-n // bs) for n, _ in seqs)
    ((k_cache, v_cache),) = random_kv_cache(need + 4, bs, kv_heads, d, kv_dtype, g)
    free = torch.randperm(need + 4, generator=g).tolist()
    blocks = [-(-n // bs) for n, _ in seqs]
    tables = torch.tensor([[free.pop() for _ in range(b)] + [0] * (max(blocks) - b) for b in blocks])
    q_len = torch.tensor([t for _, t in seqs])
    q_start = torch.cumsum(q_len, 0) - q_len
    lens = torch.tensor([n for n, _ in seqs])
    qkv = torch.randn(int(q_len.sum()), heads + 2 * kv_heads, d, generator=g)
    q = qkv[:, :heads]
    assert not q.is_contiguous()
    args = (k_cache, v_cache, None, None, tables, q_start, q_len, lens, None, 0, d**-0.5)
    got = native.paged_prefill_attention(q, *args)
    want = native.paged_prefill_attention(q.contiguous(), *args)
    assert torch.equal(got, want)
    # and the strided rows really are read: other queries in the same places give other outputs
    qkv[:, :heads] += 1.0
    assert not torch.equal(native.paged_prefill_attention(q, *args), want)
