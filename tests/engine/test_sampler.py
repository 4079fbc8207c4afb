"""The sampler: per-row parameters in one batch, truncation sets, seeds, logprobs."""

from __future__ import annotations

import torch

from tokenops.engine.sampler import Sampler, make_generator
from tokenops.engine.sampling_params import SamplingParams

V = 50


def logits_batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = logits_batch(4)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.7),
    ]
    out = Sampler()(logits, params, [None] * 4)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())
    assert out.logprobs == [None] * 4


def test_top_k_and_top_p_restrict_the_candidates():
    logits = logits_batch(1, seed=3)
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = logits[0].softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    nucleus_size = int((sorted_p.cumsum(0) - sorted_p < 0.6).sum())
    nucleus = set(order[:nucleus_size].tolist())
    sampler = Sampler()
    seen_k, seen_p = set(), set()
    for _ in range(300):
        out = sampler(logits.repeat(2, 1), [SamplingParams(top_k=5), SamplingParams(top_p=0.6)], [None, None])
        seen_k.add(out.token_ids[0])
        seen_p.add(out.token_ids[1])
    assert seen_k <= top5 and len(seen_k) > 1
    assert seen_p <= nucleus and len(seen_p) >= 1


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    g = make_generator(0, "cpu")
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[Sampler()(logits, [SamplingParams(seed=0)], [g]).token_ids[0]] += 1
    assert torch.allclose(counts / 3000, logits[0].softmax(-1), atol=0.03)


def test_seed_gives_same_tokens_whatever_the_batch():
    logits = logits_batch(6, seed=1)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)

    def draw(rows, row_of_seeded):
        g = make_generator(1234, "cpu")
        toks = []
        for _ in range(20):
            ps = [SamplingParams(temperature=1.0) for _ in rows]
            gens = [None] * len(rows)
            ps[row_of_seeded], gens[row_of_seeded] = params, g
            toks.append(Sampler()(logits[rows], ps, gens).token_ids[row_of_seeded])
        return toks

    alone = draw([2], 0)
    assert draw([0, 1, 2, 3], 2) == alone
    assert draw([2, 5], 0) == alone
    assert draw([4, 2, 0], 1) == alone


def test_logprobs_of_chosen_token_and_alternatives():
    logits = logits_batch(3, seed=2)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, logprobs=0),
    ]
    out = Sampler()(logits, params, [None] * 3)
    lp = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert abs(first.logprob - float(lp[0].max())) < 1e-5
    top = lp[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert all(abs(a - b) < 1e-5 for (_, a), b in zip(first.top, top.values.tolist(), strict=True))
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third.top == [] and abs(third.logprob - float(lp[2, out.token_ids[2]])) < 1e-5


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Top-k then top-p by a full sort of one row, the textbook way."""
    probs = (logits / p.temperature).softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    if p.top_k > 0:
        sorted_p[p.top_k :] = 0
        sorted_p = sorted_p / sorted_p.sum()
    if p.top_p < 1.0:
        sorted_p[(sorted_p.cumsum(0) - sorted_p) >= p.top_p] = 0
    out = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return out / out.sum()


def test_truncation_without_a_full_sort_equals_the_sorted_reference():
    # a 2,000-token vocabulary: a flat row's nucleus reaches past the top-p candidates (full-sort
    # fallback), a peaked row's does not; top-k wider than the candidates; both cuts in one row
    g = torch.Generator().manual_seed(7)
    flat = torch.randn(2000, generator=g) * 0.2
    peaked = torch.randn(2000, generator=g) * 6
    rows = [
        (flat, SamplingParams(top_p=0.9)),
        (peaked, SamplingParams(top_p=0.9)),
        (peaked, SamplingParams(top_k=600, top_p=0.97)),
        (flat, SamplingParams(top_k=5)),
        (peaked, SamplingParams(temperature=0.5)),
        (flat, SamplingParams(top_k=1200, top_p=0.5)),
    ]
    logits = torch.stack([r for r, _ in rows])
    got = Sampler.probs(logits, [p for _, p in rows])
    for i, (row, p) in enumerate(rows):
        want = _reference_probs(row, p)
        assert torch.equal(got[i] > 0, want > 0), i
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-6)


def _kernel(native, logits, temps, u, top_k=None, top_p=None):
    n = logits.shape[0]
    top_k = torch.zeros(n, dtype=torch.long) if top_k is None else top_k
    top_p = torch.ones(n) if top_p is None else top_p
    return native.sample_rows(logits, temps, u, top_k, top_p)


def _cdf64(row, temperature):
    """The row's cumulative softmax(row / T) in float64, -inf entries weighing exactly 0."""
    return (row.double() / temperature).softmax(-1).cumsum(-1)


def test_native_rows_take_the_first_largest_logit_when_greedy(native):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 1003, generator=g)  # vector lanes, then a 3-token tail
    logits[1, [17, 400]] = 50.0  # a tie: the first one wins, as with torch.argmax
    logits[2, :] = float("-inf")
    logits[2, 1002] = 0.0  # everything masked but the last token
    logits[3, 5:] = float("-inf")
    logits[4, [16, 9]] = 60.0  # a tie between lanes: the later lane holds the earlier index
    logits[5, [1001, 3]] = 70.0  # a tie between the tail and the lanes
    logits[6, 1002] = 80.0  # the largest in the tail alone
    got = _kernel(native, logits, torch.zeros(9), torch.rand(9, generator=g))
    assert got.tolist() == logits.argmax(-1).tolist()
    assert got[1:7].tolist() == [17, 1002, logits[3, :5].argmax().item(), 9, 3, 1002]


def test_native_draw_inverts_the_cumulative_distribution(native):
    g = torch.Generator().manual_seed(4)
    n, v = 64, 3000  # several of the kernel's chunks per row
    logits = torch.randn(n, v, generator=g) * torch.linspace(0.1, 8, n)[:, None]
    logits[::5, ::3] = float("-inf")  # masked tokens
    temps = torch.linspace(0.3, 2.0, n)
    u = torch.rand(n, generator=g)
    u[0], u[1] = 0.0, 1.0 - 2**-24  # both ends of [0, 1)
    got = _kernel(native, logits, temps, u)
    for r in range(n):
        t = int(got[r])
        cdf = _cdf64(logits[r], float(temps[r]))
        before = float(cdf[t - 1]) if t else 0.0
        assert logits[r, t] > float("-inf"), r  # a masked token is never drawn
        # u falls in the token's own interval, up to float32 rounding of the sums
        assert before - 1e-5 <= float(u[r]) <= float(cdf[t]) + 1e-5, (r, t, before, float(cdf[t]))


def test_native_and_pytorch_paths_agree_on_the_same_draws(native, monkeypatch):
    import tokenops.engine.sampler as sampler_module

    logits = logits_batch(40, seed=5)
    # greedy, plain, top-k, top-p and both cuts, each seeded
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7),
        dict(temperature=0.9, top_k=5),
        dict(temperature=1.2, top_p=0.8),
        dict(temperature=0.8, top_k=20, top_p=0.9),
    ]
    params = [SamplingParams(seed=i, **kinds[i % 5]) for i in range(40)]

    def run():
        gens = [make_generator(i, "cpu") for i in range(40)]
        return [Sampler()(logits, params, gens).token_ids for _ in range(30)]

    with_kernel = run()
    monkeypatch.setattr(sampler_module, "_native", lambda logits: None)
    without = run()
    same = sum(
        a == b
        for step_a, step_b in zip(with_kernel, without, strict=True)
        for a, b in zip(step_a, step_b, strict=True)
    )
    # the same uniforms in both: tokens differ only where a draw lands within rounding of a boundary
    assert same >= 40 * 30 - 2
    assert all(step[0] == int(logits[0].argmax()) for step in with_kernel)


def test_native_cuts_draw_inside_the_reference_support(native):
    g = torch.Generator().manual_seed(8)
    v = 2000
    flat = torch.randn(v, generator=g) * 0.2  # a nucleus of most of the vocabulary
    peaked = torch.randn(v, generator=g) * 6
    masked = peaked.clone()
    masked[peaked.topk(3).indices[1:]] = float("-inf")  # masks inside the would-be nucleus
    rows = [
        (flat, SamplingParams(top_p=0.9)),
        (peaked, SamplingParams(top_p=0.9)),
        (peaked, SamplingParams(top_k=600, top_p=0.97)),
        (flat, SamplingParams(top_k=5)),
        (flat, SamplingParams(top_k=1200, top_p=0.5)),
        (masked, SamplingParams(temperature=0.7, top_p=0.6)),
        (peaked, SamplingParams(temperature=1.5, top_k=v + 5, top_p=0.95)),  # top-k wider than V: no cut
    ]
    logits = torch.stack([r for r, _ in rows])
    params = [p for _, p in rows]
    ref = Sampler.probs(logits, params).double()
    for draw in range(40):
        u = torch.rand(len(rows), generator=g)
        if draw == 0:
            u[:] = 1.0 - 2**-24
        got = native.sample_rows(
            logits,
            torch.tensor([p.temperature for p in params]),
            u,
            torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params]),
        )
        for r, t in enumerate(got.tolist()):
            assert ref[r, t] > 0, (r, t)  # inside the cut, never a masked token
            cdf = ref[r].cumsum(0)
            before = float(cdf[t - 1]) if t else 0.0
            assert before - 1e-4 <= float(u[r]) <= float(cdf[t]) + 1e-4, (r, t)


def test_rows_with_and_without_truncation_in_one_batch():
    logits = logits_batch(4, seed=6)
    top3 = set(logits[1].topk(3).indices.tolist())
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
        SamplingParams(),
        SamplingParams(top_p=0.5),
    ]
    for _ in range(50):
        out = Sampler()(logits, params, [None] * 4)
        assert out.token_ids[0] == int(logits[0].argmax())
        assert out.token_ids[1] in top3
