"""Turning a batch of logits into one token per request, each with its own sampling parameters. Rows
are sampled together: greedy rows take the argmax; the others are scaled by their temperature, cut
to their top-k and top-p (nucleus) sets, and drawn with the exponential-race trick (argmax of p / E
with E ~ Exp(1), E drawn as -log U). Truncation never sorts the whole vocabulary unless it must
(a full sort of a batch's logits can cost more than the forward pass): top-k takes `topk(k)`, top-p
looks for its nucleus among the `TOP_P_CANDIDATES` most likely tokens first. A row with a seed draws
from its own `torch.Generator`, so its tokens depend only on its seed and its own logits, never on
the rest of the batch. Logprobs are those of the model's distribution (before temperature and
truncation), as vLLM reports them. The sampler knows nothing of sequences or stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        greedy = [p.greedy for p in params]
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)

        if any(greedy):
            rows = [i for i in range(n) if greedy[i]]
            if len(rows) == n:
                tokens = logits.argmax(dim=-1)
            else:
                idx = torch.tensor(rows, device=logits.device)
                tokens[idx] = logits[idx].argmax(dim=-1)
        if not all(greedy):
            rows = [i for i in range(n) if not greedy[i]]
            sub = [params[i] for i in rows]
            idx = torch.tensor(rows, device=logits.device)
            probs = self.probs(logits[idx], sub)
            # E = -log U is Exp(1); uniform draws are cheaper than exponential_ on CPU
            race = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
            if unseeded:
                if len(unseeded) == len(rows):
                    race.uniform_()
                else:
                    race[unseeded] = torch.empty_like(probs[unseeded]).uniform_()
            for j, i in enumerate(rows):
                g = generators[i]
                if g is not None:
                    race[j].uniform_(generator=g)
            race.log_().neg_()
            tokens[idx] = (probs / race).argmax(dim=-1)

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
