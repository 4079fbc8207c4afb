"""Turning a batch of logits into one token per request, each with its own sampling parameters.

Rows are sampled together: greedy rows take the argmax; the others are scaled by their temperature,
cut to their top-k and top-p (nucleus) sets, and drawn with the exponential-race trick
(argmax of p / E with E ~ Exp(1)), which needs one random number per vocabulary entry. A row with a
seed draws its E from its own `torch.Generator`, so its tokens depend only on its seed and its own
logits, never on what else is in the batch. Logprobs are those of the model's distribution (before
temperature and truncation), as vLLM reports them. The sampler knows nothing of sequences or stops.
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
            race = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
            if unseeded:
                if len(unseeded) == len(rows):
                    race.exponential_()
                else:
                    race[unseeded] = torch.empty_like(probs[unseeded]).exponential_()
            for j, i in enumerate(rows):
                g = generators[i]
                if g is not None:
                    race[j].exponential_(generator=g)
            tokens[idx] = (probs / race).argmax(dim=-1)

        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * n
        want = [i for i in range(n) if params[i].logprobs is not None]
        if want:
            idx = torch.tensor(want, device=logits.device)
            lp = torch.log_softmax(logits[idx], dim=-1)
            chosen = lp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
            k_max = max(params[i].logprobs or 0 for i in want)
            top_v, top_i = (lp.topk(k_max, dim=-1) if k_max > 0 else (None, None))
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
        logits = logits / temps.unsqueeze(1)
        top_ks = [p.top_k for p in params]
        top_ps = [p.top_p for p in params]
        need_k = any(k > 0 for k in top_ks)
        need_p = any(p < 1.0 for p in top_ps)
        if need_k or need_p:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
            if need_k:
                k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=dev)
                drop |= torch.arange(vocab, device=dev)[None, :] >= k[:, None]
            if need_p:
                sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
                cum = sorted_probs.cumsum(dim=-1)
                p = torch.tensor(top_ps, dtype=logits.dtype, device=dev)
                # drop a token when the mass before it already reaches top_p (the first always stays)
                drop |= (cum - sorted_probs) >= p[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)
