"""Quality of quantised routed experts against float32, on the tests' tiny random MoE configs.

For each family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: `tests/engine/conftest.py`'s `TinyMoE`) and
each `--quantization` mode, only the routed experts are quantised (`models.moe.quantize_experts`;
attention and dense layers stay float32, so the figures are the experts' alone):
- logit_rel_err: the largest logit error over a 29-token prompt, relative to the largest logit;
- top1_agree: the share of its positions whose argmax equals float32's;
- greedy_agree: the share of greedy tokens equal to float32's, position by position, over 3
  prompts of 24 new tokens (after a first difference the continuations usually part).
Random weights are harder on quantisation than trained ones (no outlier structure to exploit, and
tiny 32-96-wide experts), so these are a floor, not a forecast for a released checkpoint.

    PYTHONPATH=src python benchmarks/moe_quant_quality.py [--modes int8,int8_dynamic,int4,bf16]
Prints JSON: {family: {mode: {metric: value}}}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny model builders

from tests.engine.conftest import TinyMoE  # noqa: E402

from tokenops.engine.config import EngineConfig  # noqa: E402
from tokenops.engine.context import build_context  # noqa: E402
from tokenops.engine.kv_cache import allocate_kv_caches  # noqa: E402
from tokenops.engine.llm_engine import LLMEngine  # noqa: E402
from tokenops.engine.models import build_model  # noqa: E402
from tokenops.engine.models.moe import quantize_experts  # noqa: E402
from tokenops.engine.sampling_params import SamplingParams  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    caches = allocate_kv_caches(c.num_layers, 16, 4, c.num_kv_heads, c.head_dim, torch.float32)
    ctx = build_context([len(ids)], [len(ids)], [list(range(-(-len(ids) // 4)))], 4, caches)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), ctx))


def greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4), eos_token_ids=[])
    return engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="int8,int8_dynamic,int4,bf16")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (29,), generator=g).tolist()
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 12, 3)]
    result: dict[str, dict[str, dict[str, float]]] = {}
    for i, family in enumerate(FAMILIES):
        tiny = TinyMoE(family, seed=i)
        want = prompt_logits(tiny.model, ids)
        want_tokens = greedy(tiny.model, prompts, args.tokens)
        result[family] = {}
        for mode in args.modes.split(","):
            model = build_model(tiny.config)
            model.load_weights(tiny.hf.state_dict().items())
            quantize_experts(model, mode)
            got = prompt_logits(model, ids)
            tokens = greedy(model, prompts, args.tokens)
            same = sum(
                a == b for x, y in zip(tokens, want_tokens, strict=True) for a, b in zip(x, y, strict=True)
            )
            result[family][mode] = {
                "logit_rel_err": round(float((got - want).abs().max() / want.abs().max()), 4),
                "top1_agree": round(float(got.argmax(-1).eq(want.argmax(-1)).float().mean()), 3),
                "greedy_agree": round(same / sum(len(t) for t in want_tokens), 3),
            }
        print(json.dumps({family: result[family]}), flush=True)
    print(json.dumps({"quality_vs_float32": result, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
