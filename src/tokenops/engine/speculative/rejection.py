"""Verification of draft tokens against the target's distributions (Leviathan et al., Chen et al.).

For draft tokens x_1..x_k with draft probabilities q_i and the target's p_1..p_{k+1} (computed in
one forward pass over the sequence's last token and its drafts): accept x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a token from norm(max(0, p_i - q_i)) and
stop; if all k are accepted, emit a bonus token from p_{k+1}. Every emitted token is then
distributed exactly as the target's. A deterministic proposal (prompt lookup) has q one-hot, so x_i
is accepted with probability p_i(x_i) and the residual is p_i without x_i. Greedy requests accept
while the target's argmax agrees, which reproduces plain greedy decoding token for token.
"""

from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_logits: [k+1, V]. The accepted drafts then the target's own next token."""
    best = target_logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, x in enumerate(drafts):
        if best[i] != x:
            break
        out.append(x)
    out.append(best[len(out)])
    return out


def rejection_sample(
    target_probs: torch.Tensor,  # [k+1, V] p, after the request's temperature / top-k / top-p
    drafts: list[int],
    draft_probs: torch.Tensor | None,  # [k, V] q; None = deterministic proposal (one-hot q)
    generator: torch.Generator | None = None,
) -> list[int]:
    """The accepted prefix of `drafts` followed by one token from the target (residual or bonus)."""
    k = len(drafts)
    dev = target_probs.device
    if k:
        rows = torch.arange(k, device=dev)
        x = torch.tensor(drafts, device=dev)
        p_x = target_probs[rows, x]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, x]
        u = torch.rand(k, device=dev, generator=generator, dtype=p_x.dtype)
        # u < p/q, written without the division (q(x) > 0 for any token the draft could propose)
        rejected = (u * q_x >= p_x).nonzero()
        n_accepted = int(rejected[0]) if rejected.numel() else k
    else:
        n_accepted = 0
    if n_accepted == k:
        dist = target_probs[k]
    else:
        p = target_probs[n_accepted]
        if draft_probs is None:
            dist = p.clone()
            dist[drafts[n_accepted]] = 0.0
        else:
            dist = (p - draft_probs[n_accepted]).clamp_(min=0.0)
        if not dist.sum() > 0:  # p <= q everywhere only when p == q, where rejection has probability 0
            dist = p
    token = int(torch.multinomial(dist, 1, generator=generator))
    return [*drafts[:n_accepted], token]
