"""Turning a batch of logits into one token per request, each with its own sampling parameters. Rows
are sampled together: greedy rows take the argmax; the others are scaled by their temperature, cut
to their top-k and top-p (nucleus) sets, and drawn by inverting their cumulative distribution with
one uniform number per row (a race over the vocabulary, argmax of p / E with E ~ Exp(1), needs one
random number per token: ten times the cost of the softmax at a batch's width). Where the native
kernels are built, every row takes `sample_rows` (two reads of the logits, no [N, V] temporaries;
truncation sorts only its candidates). The PyTorch path is the reference and the fallback; its
truncation never sorts the whole vocabulary unless it must (a full sort of a batch's logits can
cost more than the forward pass): top-k takes `topk(k)`, top-p looks for its nucleus among the
`TOP_P_CANDIDATES` most likely tokens first. A row with a seed draws from its own `torch.Generator`,
so its tokens depend only on its seed and its own logits, never on the rest of the batch. Logprobs
are those of the model's distribution (before temperature and truncation), as vLLM reports them.
The sampler knows nothing of sequences or stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenops.engine import kernels
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.sequence import TokenLogprob


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        n = logits.shape[0]
        logits = logits.float()
        native = _native(logits)
        if native is not None:  # every row in one kernel call (greedy ones as T = 0)
            tokens = native.sample_rows(
                logits.contiguous(),
                torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
                _uniforms(generators, [not p.greedy for p in params], logits.dtype, logits.device),
                torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long),
                torch.tensor([p.top_p for p in params]),
            )
        else:
            tokens = self._sample_torch(logits, params, generators)

        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * n
        want = [i for i in range(n) if params[i].logprobs is not None]
        if want:
            idx = torch.tensor(want, device=logits.device)
            lp = torch.log_softmax(logits[idx], dim=-1)
            chosen = lp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
            k_max = max(params[i].logprobs or 0 for i in want)
            top_v, top_i = lp.topk(k_max, dim=-1) if k_max > 0 else (None, None)
            top_v = top_v.tolist() if top_v is not None else None
            top_i = top_i.tolist() if top_i is not None else None
            for j, i in enumerate(want):
                k = params[i].logprobs or 0
                top = list(zip(top_i[j][:k], top_v[j][:k], strict=True)) if k and top_i is not None else []
                logprobs[i] = TokenLogprob(token_list[i], chosen[j], top)
        return SamplerOutput(token_list, logprobs)

    def _sample_torch(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """The PyTorch path: greedy rows by `argmax`, the others by `_draw` over `probs`."""
        n = logits.shape[0]
        greedy = [i for i in range(n) if params[i].greedy]
        if len(greedy) == n:
            return logits.argmax(dim=-1)
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        rows = [i for i in range(n) if not params[i].greedy]
        if len(rows) == n:  # no copy of the batch's logits
            return _draw(self.probs(logits, params), generators)
        idx = torch.tensor(rows, device=logits.device)
        tokens[idx] = _draw(self.probs(logits[idx], [params[i] for i in rows]), [generators[i] for i in rows])
        return tokens

    @staticmethod
    def probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature-scaled, top-k/top-p-truncated probabilities, one row per request."""
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
        probs = (logits / temps.unsqueeze(1)).softmax(dim=-1)
        cut = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if cut:
            idx = torch.tensor(cut, device=dev)
            probs[idx] = _truncate(probs[idx], [params[j] for j in cut])
        return probs


def _native(logits: torch.Tensor) -> object | None:
    return kernels.ops(logits.device) if logits.device.type == "cpu" and logits.dim() == 2 else None


def _uniforms(
    generators: list[torch.Generator | None], draws: list[bool], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[N] uniform numbers in [0, 1): one from each drawing row's own generator, or from the default
    one for unseeded rows (in one call); 0 for rows that draw nothing (greedy), which consume none."""
    n = len(generators)
    u = torch.zeros(n, dtype=dtype, device=device)
    unseeded = [j for j, g in enumerate(generators) if g is None and draws[j]]
    if len(unseeded) == n:
        u.uniform_()
    elif unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=dtype, device=device)
    for j, g in enumerate(generators):
        if g is not None and draws[j]:
            u[j : j + 1].uniform_(generator=g)
    return u


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` ([N, V], zeros allowed): the first whose cumulative mass passes
    u times the row's total, u from `_uniforms`, so a zero-probability token is never drawn (the
    PyTorch form of the native `sample_rows`, for truncated rows and where there is no kernel)."""
    cdf = probs.cumsum(dim=-1)
    u = _uniforms(generators, [True] * len(generators), probs.dtype, probs.device)
    total = cdf[:, -1:]
    chosen = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # u * total can round up to the total itself: then take the last token with mass
    past = chosen >= probs.shape[1]
    if past.any():
        last = torch.searchsorted(cdf, total, right=False)
        chosen = torch.where(past, last, chosen)
    return chosen.squeeze(1)


# top-p looks for its nucleus among this many most likely tokens first (see the module docstring)
TOP_P_CANDIDATES = 256


def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero what top-k, then top-p (on the top-k-renormalised mass) drop; renormalise the rest."""
    dev = probs.device
    vocab = probs.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    # candidates per row: its top-k set, or for top-p alone the most likely TOP_P_CANDIDATES tokens
    width = max(
        k if k < vocab or p >= 1.0 else min(vocab, TOP_P_CANDIDATES) for k, p in zip(ks, top_ps, strict=True)
    )
    if width >= vocab:
        cand, order = probs.sort(dim=-1, descending=True)
    else:
        cand, order = probs.topk(width, dim=-1)
    k = torch.tensor(ks, device=dev)
    drop = torch.arange(width, device=dev)[None, :] >= k[:, None]
    cand = cand.masked_fill(drop, 0.0)
    # a row whose top-k is the whole vocabulary keeps mass 1 even where its candidates hold less
    full = (k >= vocab)[:, None]
    cand = cand / torch.where(full, torch.ones_like(cand[:, :1]), cand.sum(dim=-1, keepdim=True))
    short: list[int] = []  # rows whose nucleus may reach past their candidates
    if any(p < 1.0 for p in top_ps):
        p = torch.tensor(top_ps, dtype=probs.dtype, device=dev)[:, None]
        cum = cand.cumsum(dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        cand = cand.masked_fill((cum - cand) >= p, 0.0)
        if width < vocab:
            short = ((cum[:, -1:] < p) & full).squeeze(1).nonzero().flatten().tolist()
    out = torch.zeros_like(probs).scatter_(1, order, cand)
    if short:
        rows = torch.tensor(short, device=dev)
        out[rows] = _truncate_by_sort(probs[rows], p[rows])
    return out / out.sum(dim=-1, keepdim=True)


def _truncate_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p over the whole sorted vocabulary (rows without top-k whose nucleus is wide)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    sorted_p = sorted_p.masked_fill((sorted_p.cumsum(dim=-1) - sorted_p) >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)
