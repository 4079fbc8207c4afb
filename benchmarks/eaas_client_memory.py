"""Resident memory of an MoE engine loaded whole against loaded as an Expert-as-a-Service client
(`load_model(..., routed_experts=False)`: no routed-expert weights, only their fingerprints
streamed from the checkpoint), and of an expert server's shard, each in a fresh process.

A random Qwen3-MoE (transformers, saved as an HF folder with experts as separate tensors) of
`--layers` layers, `--experts` experts of `--expert-ffn`, hidden `--hidden`. Per mode: the peak
(VmHWM) and the resident size (VmRSS) after loading, above the process's size after one warm-up
client load (imports and one-time set-up out of the way), in MiB.

    PYTHONPATH=src .venv/bin/python benchmarks/eaas_client_memory.py [--layers 4 --experts 16]

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

PROBE = """
import sys
from tokenops.engine.loader import load_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

folder, mode = sys.argv[1], sys.argv[2]
load_model(folder, routed_experts=False)  # warm-up: imports
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM restarts from the current resident size
before = status("VmRSS:")
if mode == "server-half":
    from tokenops.engine.eaas.checkpoint import read_expert_shard

    held = read_expert_shard(folder, sys.argv[3])
else:
    held = load_model(folder, routed_experts=mode == "whole")
print(status("VmHWM:") - before, status("VmRSS:") - before)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-ffn", type=int, default=1024)
    args = ap.parse_args()
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    began, load_start = datetime.now(UTC).isoformat(timespec="seconds"), os.getloadavg()
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_ffn, num_experts=args.experts, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    expert_bytes = args.layers * args.experts * 3 * args.hidden * args.expert_ffn * 4
    out: dict = {"config": config.to_diff_dict(), "routed_expert_mib": expert_bytes / 2**20}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
        tok = Tokenizer(models.BPE(vocab={chr(i + 33): i for i in range(200)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        (folder / "tokenizer.json").write_text(tok.to_str())
        half = f"0-{args.experts // 2 - 1}"
        for mode in ("whole", "client", "server-half"):
            run = subprocess.run(
                [sys.executable, "-c", PROBE, str(folder), mode, half],
                capture_output=True,
                text=True,
                check=True,
            )
            peak, rss = (int(x) for x in run.stdout.split()[-2:])
            out[mode] = {"peak_mib": round(peak / 2**20, 1), "resident_mib": round(rss / 2**20, 1)}
    out.update(began_utc=began, ended_utc=datetime.now(UTC).isoformat(timespec="seconds"),
               load_start=load_start, load_end=os.getloadavg())  # fmt: skip
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
