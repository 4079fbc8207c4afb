"""Tokens/s of one MoE layer's routed experts: our grouped execution against naive loops.

Random weights in two shapes, neither a released model's full width (so a run stays short on a
2-core CPU) but each with its family's expert count and top-k:
- mixtral-like: hidden 1024, expert intermediate 3584, 8 experts, top-2;
- qwen2moe-like: hidden 1024, expert intermediate 704, 60 experts, top-4.
Peers, interleaved per repeat, on the same tokens, routing and weights (float32):
- per_token: a Python loop over tokens and their k experts (the naive implementation);
- per_expert_mask: transformers' eager loop (one-hot mask, one matmul per hit expert, index_add);
- grouped_loop: ours without the grouped op: slots sorted by expert, one matmul per expert;
- grouped_mm: ours (`models.moe.Experts`): slots sorted by expert, one `torch._grouped_mm` per projection;
- int8 / int8_dynamic: ours with `--quantization` (`models.moe.QuantizedExperts`): each expert's
  projections as the engine's weight-only int8 / W8A8 layers, one expert at a time over its rows.
The float outputs are checked equal before timing; the quantised ones' largest error relative to
the largest output is reported (`quantized_rel_err`).

    PYTHONPATH=src python benchmarks/moe_block.py [--tokens 1,8,64,256] [--repeats 5] [--threads 2]
Prints JSON: {shape: {tokens: {peer: median tokens/s}}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tokenops.engine.models.moe import Experts, QuantizedExperts, run_experts_grouped, sort_by_expert
from tokenops.engine.quantize import dynamic_int8_unavailable

SHAPES = {"mixtral-like": (1024, 3584, 8, 2), "qwen2moe-like": (1024, 704, 60, 4)}


def per_token(ex: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = F.linear(x[t : t + 1], ex.gate_up_proj[e]).chunk(2, dim=-1)
            out[t] += w[t, k] * F.linear(F.silu(gate) * up, ex.down_proj[e])[0]
    return out


def per_expert_mask(ex: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=ex.num_experts).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
        slot, token = torch.where(mask[e])
        gate, up = F.linear(x[token], ex.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, ex.down_proj[e]) * w[token, slot, None]
        out.index_add_(0, token, y)
    return out


def grouped(use_mm: bool):
    def run(ex: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        order, counts = sort_by_expert(ids, ex.num_experts)
        token = order // ids.shape[1]
        y = run_experts_grouped(x[token], counts, ex.gate_up_proj, ex.down_proj, use_mm)
        return torch.zeros_like(x).index_add_(0, token, y * w.reshape(-1)[order][:, None])

    return run


PEERS = {
    "per_token": per_token,
    "per_expert_mask": per_expert_mask,
    "grouped_loop": grouped(False),
    "grouped_mm": grouped(True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    result: dict[str, dict[int, dict[str, float]]] = {}
    errors: dict[str, dict[int, dict[str, float]]] = {}
    for shape, (hidden, inter, experts, top_k) in SHAPES.items():
        ex = Experts(experts, hidden, inter)
        with torch.no_grad():
            ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.02)
            ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.02)
        modes = [m for m in ("int8", "int8_dynamic") if m == "int8" or not dynamic_int8_unavailable("cpu")]
        peers = dict(PEERS)
        for mode in modes:
            peers[mode] = (lambda q: lambda ex, x, ids, w: q.forward(x, ids, w))(QuantizedExperts(ex, mode))
        result[shape] = {}
        errors[shape] = {}
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, hidden, generator=g)
            probs = torch.softmax(torch.randn(n, experts, generator=g), dim=-1)
            w, ids = torch.topk(probs, top_k, dim=-1)
            times: dict[str, list[float]] = {p: [] for p in peers}
            with torch.no_grad():
                ref = per_expert_mask(ex, x, ids, w)
                for fn in PEERS.values():
                    torch.testing.assert_close(fn(ex, x, ids, w), ref, rtol=1e-3, atol=1e-4)
                errors[shape][n] = {
                    m: round(float((peers[m](ex, x, ids, w) - ref).abs().max() / ref.abs().max()), 4)
                    for m in modes
                }
                for _ in range(args.repeats):
                    for name, fn in peers.items():
                        t0 = time.perf_counter()
                        fn(ex, x, ids, w)
                        times[name].append(time.perf_counter() - t0)
            result[shape][n] = {p: round(n / statistics.median(ts), 1) for p, ts in times.items()}
            print(json.dumps({shape: {n: result[shape][n]}}), flush=True)
    summary = {"tokens_per_s": result, "quantized_rel_err": errors}
    print(json.dumps({**summary, "threads": args.threads, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
