"""A tiny random Mixtral served monolithic against Expert-as-a-Service with 2 and 4 expert-server
processes on loopback: decode tokens/s, the cost of the transport per MoE layer call, and the
throughput dip when one expert server is killed mid-run.

The model (random weights, transformers' Mixtral init, saved as an HF folder): hidden 256, 4 layers,
8 experts of intermediate 1024, top-2. Peers, in one run:
- monolithic: the engine computes its experts itself;
- eaas_2 / eaas_4: `tokenops expert-server` processes holding disjoint halves / quarters, layer by
  layer; eaas_2_overlap / eaas_4_overlap: the same servers with double batching (each step's
  sequences as two micro-batches, one's attention while the other's experts are on the servers);
- layer_call: one MoE layer call of `--batch` tokens, local experts against the remote dispatch
  (2 servers): the difference is what the transport costs per call;
- failover: 4 servers, every expert on two of them; decode steps are timed before and after one
  server is killed (after the kill the survivors also carry its rows);
- server_rss_mb: the resident memory of each server process (of 2, of 4, and one holding all
  experts): a server reads only its experts from the checkpoint.
Every EaaS run must give the monolithic tokens (checked).

    PYTHONPATH=src python benchmarks/eaas_loopback.py [--batch 8] [--tokens 24] [--repeats 3]
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenops.engine.config import EngineConfig
from tokenops.engine.eaas.client import ExpertClient
from tokenops.engine.eaas.server import spawn_expert_server
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.sampling_params import SamplingParams


def make_folder(folder: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
    )
    hf = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # spread the routing over the experts
    hf.save_pretrained(folder)
    tok = Tokenizer(models.BPE(vocab={chr(i + 33): i for i in range(300)}, merges=[]))
    (folder / "tokenizer.json").write_text(tok.to_str())


def engine(model) -> LLMEngine:
    return LLMEngine(
        model, EngineConfig(num_kv_blocks=512, block_size=16, max_num_batched_tokens=256), eos_token_ids=[]
    )


def decode_run(
    model, prompts: list[list[int]], params: SamplingParams, on_step=None
) -> tuple[list, list[float]]:
    """(tokens per prompt, seconds of each decode step)."""
    eng = engine(model)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps: list[float] = []
    n = 0
    while eng.has_unfinished():
        if on_step is not None:
            on_step(n)
        t0 = time.perf_counter()
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        if n:  # step 0 is the prefill
            steps.append(time.perf_counter() - t0)
        n += 1
    return [out[f"r{i}"] for i in range(len(prompts))], steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (16,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    result: dict = {"batch": args.batch, "max_tokens": args.tokens, "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_folder(folder)
        model = load_model(str(folder)).model
        reference, _ = decode_run(model, prompts, params)

        def tokens_per_s(steps: list[float]) -> float:
            return round(args.batch / statistics.median(steps), 1)

        runs = {"monolithic": []}
        for _ in range(args.repeats):
            tokens, steps = decode_run(model, prompts, params)
            assert tokens == reference
            runs["monolithic"].append(tokens_per_s(steps))
        rss: dict[str, list[float]] = {}
        for name, specs in (("eaas_2", ["0-3", "4-7"]), ("eaas_4", ["0,1", "2,3", "4,5", "6,7"])):
            procs = [spawn_expert_server(folder, s) for s in specs]
            rss[name] = [rss_mb(p.pid) for p, _ in procs]
            client = ExpertClient(model)
            try:
                for _, addr in procs:
                    client.register(addr)
                # interleaved per repeat: layer by layer, and double batched (attention of one
                # micro-batch while the other's experts are on the servers)
                runs[name], runs[f"{name}_overlap"] = [], []
                for _ in range(args.repeats):
                    for peer, overlap in ((name, False), (f"{name}_overlap", True)):
                        client.attach(model, overlap=overlap)
                        tokens, steps = decode_run(model, prompts, params)
                        ExpertClient.detach(model)
                        assert tokens == reference, f"{peer} changed the tokens"
                        runs[peer].append(tokens_per_s(steps))
                client.attach(model)
                if name == "eaas_2":
                    result["layer_call_ms"] = layer_call(model, client, args.batch, args.repeats)
            finally:
                ExpertClient.detach(model)
                client.close()
                for p, _ in procs:
                    p.kill()
                    p.wait()
        whole, _ = spawn_expert_server(folder, "all")
        rss["all_experts"] = [rss_mb(whole.pid)]
        whole.kill()
        whole.wait()
        result["server_rss_mb"] = rss
        result["decode_tokens_per_s"] = {k: statistics.median(v) for k, v in runs.items()}
        result["decode_tokens_per_s_runs"] = runs
        result["failover"] = failover(folder, model, prompts, params, reference)
    print(json.dumps(result))


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def layer_call(model, client: ExpertClient, batch: int, repeats: int) -> dict[str, float]:
    """Median ms of one layer-0 MoE call of `batch` tokens: local experts, then through the servers."""
    block = model.model.layers[0].mlp
    x = torch.randn(batch, block.experts.gate_up_proj.shape[2])
    ids, w = block.gate.forward(x)
    out: dict[str, float] = {}
    with torch.no_grad():
        for name, fn in (("local", block.experts.forward), ("remote", lambda *a: client.dispatch(0, *a))):
            ts = []
            for _ in range(20 * repeats):
                t0 = time.perf_counter()
                fn(x, ids, w)
                ts.append(time.perf_counter() - t0)
            out[name] = round(statistics.median(ts) * 1e3, 3)
    out["transport"] = round(out["remote"] - out["local"], 3)
    return out


def failover(folder: Path, model, prompts, params: SamplingParams, reference) -> dict:
    procs = [spawn_expert_server(folder, s) for s in ("0-3", "0-3", "4-7", "4-7")]
    client = ExpertClient(model)
    try:
        for _, addr in procs:
            client.register(addr)
        client.attach(model)
        kill_at = params.max_tokens // 2

        def on_step(n: int) -> None:
            if n == kill_at:
                procs[0][0].kill()
                procs[0][0].wait()

        tokens, steps = decode_run(model, prompts, params, on_step)
        assert tokens == reference, "failover changed the tokens"
        before, after = steps[: kill_at - 1], steps[kill_at:]
        return {
            "tokens_per_s_before_kill": round(len(prompts) / statistics.median(before), 1),
            "kill_step_ms": round(steps[kill_at - 1] * 1e3, 2),
            "tokens_per_s_after_kill": round(len(prompts) / statistics.median(after), 1),
            "failovers": client.failovers,
            "tokens_identical": True,
        }
    finally:
        ExpertClient.detach(model)
        client.close()
        for p, _ in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
