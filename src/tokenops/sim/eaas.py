"""Expert-as-a-Service at fleet scale: an MoE model served either by monolithic expert-parallel
groups (every GPU of a group runs attention for its rows and holds 1/G of the routed experts; the
group scales, and fails, as one unit) or by EaaS (attention clients that keep the dense weights and
the KV cache, and stateless expert servers that hold replicated experts; each pool scales one GPU at
a time, and a failed expert server's rows go to the replicas of its experts).

Step times use the `PerfModel` form, derived from the model's shapes and a GPU's roofline (weights
read once per step, a per-token cost, KV read per context token, prefill attention per (query,
context) pair), not fitted: there are no GPU measurements of either layout here. Prefill is chunked
into the decode steps: in steady state every output token brings `prompt / output` prompt tokens,
which run through attention and the experts in the same steps. With two micro-batches in flight
(the paper's double batching, DeepSeek's two-micro-batch overlap) a step takes the longest of its
compute and its all-to-all traffic; in a monolithic group each GPU computes attention and experts
one after the other, in EaaS on different GPUs. `plan_monolithic` / `plan_eaas` size a fleet for a
decode token rate under a time-per-output-token SLO; `failure_timeline` runs the fleets step by step
on the event loop through a failure. Expert loads may drift over the day (`drifting_loads`: the
traffic mix moves between two routing populations); placement is the live one
(`cluster.expert_placement.place_experts`, EPLB's policy), recomputed from the loads measured one
interval earlier as often as `gpu_hours` is told, and a step is timed with the loads of its own
interval, so a stale placement costs what its imbalance costs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenops.cluster.expert_placement import Placement, place_experts
from tokenops.cluster.perf_model import PerfModel, StepShape
from tokenops.sim.events import EventLoop


@dataclass(frozen=True, slots=True)
class MoEModel:
    """The shapes that set an MoE decode step's cost (names as in the models' HF configs)."""

    name: str
    layers: int  # num_hidden_layers
    moe_layers: int  # layers with routed experts
    hidden: int  # hidden_size
    experts: int  # routed experts per MoE layer
    top_k: int  # num_experts_per_tok
    expert_ffn: int  # moe_intermediate_size (gate, up and down projections)
    dense_params: float  # every parameter outside the routed experts (attention, shared experts, ...)
    weight_bytes: float  # bytes per weight as served
    kv_bytes_per_token: int  # KV cache of one token over all layers
    attention_flops_per_pair: float = 0.0  # one query token against one context token, all layers
    dispatch_bytes: float = 1.0  # bytes per activation element sent to an expert (fp8 in DeepEP)
    combine_bytes: float = 2.0  # ... and returned (bf16)
    source: str = ""

    @property
    def expert_column_bytes(self) -> float:
        """One expert index over every MoE layer: what a server holds per expert slot."""
        return 3 * self.hidden * self.expert_ffn * self.weight_bytes * self.moe_layers

    @property
    def routed_bytes(self) -> float:
        return self.expert_column_bytes * self.experts

    @property
    def dense_bytes(self) -> float:
        return self.dense_params * self.weight_bytes

    @property
    def slot_flops(self) -> float:
        """One (token, expert) pair over every MoE layer."""
        return 2 * 3 * self.hidden * self.expert_ffn * self.moe_layers

    @property
    def row_wire_bytes(self) -> float:
        """What one token sends to and gets back from its experts in one step. In a monolithic group
        both kinds cross each direction of a GPU's link (its tokens' dispatch out and others'
        combine out, and the converse in), so this is per direction too."""
        return self.top_k * self.hidden * (self.dispatch_bytes + self.combine_bytes) * self.moe_layers

    @property
    def pair_wire_bytes(self) -> float:
        """One (token, expert) pair on an EaaS link: the client sends its dispatch and receives its
        combine (a server the converse), one in each direction of a full-duplex link, so the
        larger of the two is what takes time."""
        return self.hidden * max(self.dispatch_bytes, self.combine_bytes) * self.moe_layers


# DeepSeek-V3: deepseek-ai/DeepSeek-V3 config.json (61 layers, first_k_dense_replace 3, hidden 7168,
# 256 routed experts, top-8, moe_intermediate_size 2048, MLA kv_lora_rank 512 + rope 64), FP8 weights
# as released; 671B parameters in all (the technical report), of which the routed experts are
# 256 x 58 x 3 x 7168 x 2048; the MLA cache in bf16. Prefill attention: 128 heads, scores over
# 128 + 64 dims and values of 128, 2 FLOPs a multiply-add.
DEEPSEEK_V3 = MoEModel(
    "deepseek-v3", layers=61, moe_layers=58, hidden=7168, experts=256, top_k=8, expert_ffn=2048,
    dense_params=671e9 - 256 * 58 * 3 * 7168 * 2048, weight_bytes=1.0, kv_bytes_per_token=61 * 576 * 2,
    attention_flops_per_pair=61 * 128 * 2 * (192 + 128),
    source="deepseek-ai/DeepSeek-V3 config.json; 671B total (DeepSeek-V3 technical report); FP8 weights",
)  # fmt: skip
# Mixtral-8x22B: mistralai/Mixtral-8x22B-v0.1 config.json (56 layers, hidden 6144, 8 experts, top-2,
# intermediate 16384, 48 query and 8 KV heads of 128); 141B parameters (Mistral's announcement); bf16.
MIXTRAL_8X22B = MoEModel(
    "mixtral-8x22b", layers=56, moe_layers=56, hidden=6144, experts=8, top_k=2, expert_ffn=16384,
    dense_params=141e9 - 8 * 56 * 3 * 6144 * 16384, weight_bytes=2.0, kv_bytes_per_token=56 * 2 * 8 * 128 * 2,
    attention_flops_per_pair=56 * 48 * 2 * (128 + 128), dispatch_bytes=2.0,
    source="mistralai/Mixtral-8x22B-v0.1 config.json; 141B total; bf16",
)  # fmt: skip
MODELS = {m.name: m for m in (DEEPSEEK_V3, MIXTRAL_8X22B)}


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    flops: float  # dense tensor FLOP/s at the weights' precision
    net_bytes_per_s: float  # scale-out bandwidth per GPU (the all-to-all's)
    memory_efficiency: float = 0.75  # assumed share of peak a decode kernel reaches
    compute_efficiency: float = 0.5
    usable_memory: float = 0.9  # of memory_bytes, as vLLM's gpu_memory_utilization
    layer_overhead_s: float = 30e-6  # per layer and step: kernel launches
    a2a_latency_s: float = 30e-6  # per MoE layer and step: the all-to-all's round trip, in both layouts
    source: str = ""


# NVIDIA H100 SXM5 datasheet (80 GB HBM3 at 3.35 TB/s, 1,979 dense FP8 TFLOP/s) and one 400 Gb/s
# InfiniBand NIC per GPU (DeepSeek-V3 report's cluster); efficiencies and overheads are assumptions.
H100 = GPU("h100-sxm", 80e9, 3.35e12, 1979e12, 50e9, source="NVIDIA H100 SXM5 datasheet; 400 Gb/s IB per GPU")


def attention_perf(model: MoEModel, gpu: GPU) -> PerfModel:
    """One GPU's attention and dense part of a step: its dense weights read once, a token's (decode
    row's or prompt token's) dense FLOPs, each decode context token's KV read, each prefill (query,
    context) pair's FLOPs."""
    bw = gpu.hbm_bytes_per_s * gpu.memory_efficiency
    compute = gpu.flops * gpu.compute_efficiency
    return PerfModel(
        name=f"{model.name}-{gpu.name}-attention",
        base_s=model.dense_bytes / bw + model.layers * gpu.layer_overhead_s,
        per_token_s=2 * model.dense_params / compute,
        decode_row_s=2 * model.dense_params / compute,
        decode_attention_s=model.kv_bytes_per_token / bw,
        prefill_attention_s=model.attention_flops_per_pair / compute,
        source=f"roofline of {model.source} on {gpu.source}",
    )


def expert_perf(model: MoEModel, gpu: GPU, columns: float) -> PerfModel:
    """One GPU's routed-expert part of a decode step holding `columns` expert slots: their weights
    read once, each (token, expert) pair's FLOPs as a 'row'."""
    bw = gpu.hbm_bytes_per_s * gpu.memory_efficiency
    return PerfModel(
        name=f"{model.name}-{gpu.name}-experts-{columns:g}",
        base_s=columns * model.expert_column_bytes / bw,
        decode_row_s=model.slot_flops / (gpu.flops * gpu.compute_efficiency),
        source=f"roofline of {model.source} on {gpu.source}",
    )


def wire_time(model: MoEModel, gpu: GPU, rows: float) -> float:
    """A monolithic GPU's all-to-all time for `rows` tokens' traffic."""
    return rows * model.row_wire_bytes / gpu.net_bytes_per_s


def client_wire_time(model: MoEModel, gpu: GPU, tokens: float) -> float:
    """An EaaS client's link time for its `tokens`' pairs."""
    return tokens * model.top_k * model.pair_wire_bytes / gpu.net_bytes_per_s


@dataclass(frozen=True, slots=True)
class Workload:
    """Demand's shape and its SLO: mean context per running decode row, the time per output token,
    and the mean prompt and output lengths (prompt 0: decode only)."""

    context_tokens: float = 2048
    tpot_slo_s: float = 0.05
    prompt_tokens: float = 0.0
    output_tokens: float = 256.0

    @property
    def prefill_per_row(self) -> float:
        """Prompt tokens prefilled per output token decoded, in steady state."""
        return self.prompt_tokens / self.output_tokens

    def step_shape(self, rows: int) -> StepShape:
        """A step of `rows` decode rows with its steady-state share of chunked prefill."""
        new = rows * self.prefill_per_row
        return StepShape(
            prefill_tokens=new,  # a mean, so fractional
            prefill_attention=new * self.prompt_tokens / 2,
            decode_rows=rows,
            decode_context=round(rows * self.context_tokens),
        )

    def step_tokens(self, rows: float) -> float:
        """Tokens through the experts (and the all-to-all) in a step of `rows` decode rows."""
        return rows * (1 + self.prefill_per_row)


def expert_loads(experts: int, skew: float = 0.6, seed: int = 0) -> list[float]:
    """Per-expert routed load after load balancing: 1 + skew * u, u uniform (max/min <= 1 + skew)."""
    import random

    rng = random.Random(seed)
    return [1.0 + skew * rng.random() for _ in range(experts)]


def drifting_loads(
    experts: int, intervals: int, sigma: float = 0.5, seed: int = 0, interval_s: float = 600.0
) -> list[tuple[float, ...]]:
    """Per interval of a day, per-expert routed load (mean 1) whose hot experts move: the traffic
    mix shifts between two populations (say, two regions' users) whose routing favours different
    experts (each a log-normal popularity of spread `sigma`), from the first's (04:00) to the
    second's (16:00) and back, on the cosine of `diurnal`."""
    import random

    rng = random.Random(seed)
    a = [math.exp(sigma * rng.gauss(0, 1)) for _ in range(experts)]
    b = [math.exp(sigma * rng.gauss(0, 1)) for _ in range(experts)]
    out = []
    for i in range(intervals):
        h = (i + 0.5) * interval_s / 3600
        m = 0.5 * (1 - math.cos(2 * math.pi * (h - 4) / 24))
        mix = [(1 - m) * x + m * y for x, y in zip(a, b, strict=True)]
        mean = sum(mix) / experts
        out.append(tuple(w / mean for w in mix))
    return out


def imbalance(placement: Placement, load: Sequence[float]) -> float:
    """The busiest server's load over the mean when `placement` serves `load` (which may not be the
    load it was computed from): each expert's load split evenly over its replicas."""
    per = [sum(load[e] / placement.replicas[e] for e in held) for held in placement.servers]
    mean = sum(per) / len(per)
    return max(per) / mean if mean else 1.0


@functools.lru_cache(maxsize=8192)
def _placed(load: tuple[float, ...], servers: int, slots: int, min_replicas: int = 1) -> Placement:
    return place_experts(load, servers, slots, min_replicas)


# -- monolithic expert-parallel groups -----------------------------------------------------------------


@dataclass(frozen=True)
class GroupPlan:
    gpus_per_group: int
    rows_per_gpu: int  # decode rows each GPU runs at the SLO (its KV room or the step time binds)
    step_s: float
    tokens_per_s: float  # one group's decode throughput at the SLO
    imbalance: float  # busiest GPU's expert load over the mean


def monolithic_group(
    model: MoEModel,
    gpu: GPU,
    wl: Workload,
    gpus: int,
    load: Sequence[float] | None = None,
    placed_on: Sequence[float] | None = None,
) -> GroupPlan:
    """The largest batch per GPU of a G-GPU expert-parallel group that meets the TPOT SLO and fits
    in memory (dense weights on every GPU, 1/G of the routed experts, the rest KV). The experts are
    placed for `placed_on` (default: `load`) and serve `load`."""
    load = tuple(load) if load is not None else tuple(expert_loads(model.experts))
    columns = math.ceil(model.experts / gpus)
    placement = _placed(tuple(placed_on) if placed_on is not None else load, gpus, columns)
    skew = imbalance(placement, load)
    free = gpu.memory_bytes * gpu.usable_memory - model.dense_bytes - columns * model.expert_column_bytes
    if free <= 0:
        raise ValueError(f"{gpus} GPUs cannot hold {model.name}")
    kv_rows = int(free // (model.kv_bytes_per_token * wl.context_tokens))
    attn = attention_perf(model, gpu)
    experts = expert_perf(model, gpu, columns)
    best = None
    for rows in range(1, kv_rows + 1):
        step = monolithic_step(model, gpu, wl, attn, experts, skew, gpus, rows)
        if step > wl.tpot_slo_s:
            break
        best = (rows, step)
    if best is None:
        raise ValueError(f"a {gpus}-GPU group of {model.name} cannot meet TPOT {wl.tpot_slo_s}s")
    rows, step = best
    return GroupPlan(gpus, rows, step, gpus * rows / step, skew)


def monolithic_step(
    model: MoEModel,
    gpu: GPU,
    wl: Workload,
    attn: PerfModel,
    experts: PerfModel,
    skew: float,
    gpus: int,
    rows: int,
) -> float:
    """Attention then experts on the same GPU; the all-to-all overlapped with them. `skew`: the
    busiest GPU's expert load over the mean."""
    tokens = wl.step_tokens(rows)
    slots = tokens * model.top_k * skew  # the busiest GPU's pairs: G x tokens x k over G, skewed
    compute = attn.step_time(wl.step_shape(rows)) + experts.step_time(StepShape.decode(round(slots), 0))
    return max(compute, wire_time(model, gpu, tokens * (gpus - 1) / gpus)) + sync_time(model, gpu)


# -- EaaS: attention clients and expert servers -----------------------------------------------------


@dataclass(frozen=True)
class EaaSPlan:
    clients: int
    servers: int
    rows_per_client: int
    step_s: float
    tokens_per_s: float
    placement: Placement = field(repr=False)

    @property
    def gpus(self) -> int:
        return self.clients + self.servers


def sync_time(model: MoEModel, gpu: GPU) -> float:
    return model.moe_layers * gpu.a2a_latency_s


def client_busy(model: MoEModel, gpu: GPU, wl: Workload, attn: PerfModel, rows: int) -> float:
    """An attention client's own part of a step: its compute or its tokens' expert traffic, overlapped."""
    return max(attn.step_time(wl.step_shape(rows)), client_wire_time(model, gpu, wl.step_tokens(rows)))


def client_rows(model: MoEModel, gpu: GPU, wl: Workload) -> int:
    """Rows one attention client runs at the SLO: its KV room, its step and its wire time bound it
    (the expert servers are sized apart)."""
    attn = attention_perf(model, gpu)
    free = gpu.memory_bytes * gpu.usable_memory - model.dense_bytes
    rows = int(free // (model.kv_bytes_per_token * wl.context_tokens))
    while rows > 0 and client_busy(model, gpu, wl, attn, rows) + sync_time(model, gpu) > wl.tpot_slo_s:
        rows -= 1
    if rows < 1:
        raise ValueError(f"one attention client of {model.name} cannot meet TPOT {wl.tpot_slo_s}s")
    return rows


def server_times(
    model: MoEModel, gpu: GPU, placement: Placement, load: Sequence[float], rows: float, alive: Sequence[bool]
) -> list[float]:
    """Each live server's time per step for `rows` tokens through the experts in the fleet (decode
    rows and prompt tokens): its slots' weights read once, its share of the (token, expert) pairs
    computed and received. An expert's pairs split evenly over its live replicas."""
    live = [0] * len(load)
    for s, held in enumerate(placement.servers):
        if alive[s]:
            for e in held:
                live[e] += 1
    if not all(live):
        raise ExpertUnavailable(f"experts {[e for e, n in enumerate(live) if not n]} have no live replica")
    pairs = rows * model.top_k / sum(load)
    flops = model.slot_flops / (gpu.flops * gpu.compute_efficiency)
    wire = model.pair_wire_bytes / gpu.net_bytes_per_s
    out = []
    for s, held in enumerate(placement.servers):
        if not alive[s]:
            continue
        n = pairs * sum(load[e] / live[e] for e in held)
        weights = expert_perf(model, gpu, len(held)).base_s
        out.append(max(weights + n * flops, n * wire))
    return out


class ExpertUnavailable(RuntimeError):
    """No live server holds some routed expert: the step cannot run."""


def plan_eaas(
    model: MoEModel,
    gpu: GPU,
    wl: Workload,
    tokens_per_s: float,
    min_replicas: int = 2,
    load: Sequence[float] | None = None,
    spare: bool = False,
    placed_on: Sequence[float] | None = None,
) -> EaaSPlan:
    """The fewest GPUs (clients + servers) that decode `tokens_per_s` within the TPOT SLO: clients
    from their rows per step; servers the smallest count whose slowest server keeps up, every expert
    held `min_replicas` times (so a failed server leaves a replica). With `spare`, the SLO must also
    hold with the busiest server down. The experts are placed for `placed_on` (default: `load`, what
    was measured when placing) and serve `load`."""
    load = tuple(load) if load is not None else tuple(expert_loads(model.experts))
    placed = tuple(placed_on) if placed_on is not None else load
    rows = client_rows(model, gpu, wl)
    clients = max(1, math.ceil(tokens_per_s * wl.tpot_slo_s / rows))  # rows / step >= rows / SLO
    servers, placement, step = _expert_pool(model, gpu, wl, rows, clients, min_replicas, load, spare, placed)
    return EaaSPlan(clients, servers, rows, step, clients * rows / step, placement)


@functools.lru_cache(maxsize=4096)
def _expert_pool(
    model: MoEModel,
    gpu: GPU,
    wl: Workload,
    rows: int,
    clients: int,
    min_replicas: int,
    load: tuple[float, ...],
    spare: bool,
    placed: tuple[float, ...],
) -> tuple[int, Placement, float]:
    """Expert servers for `clients` attention clients of `rows` rows each: (count, placement, step)."""
    fleet_rows = wl.step_tokens(rows * clients)
    per_server = int(gpu.memory_bytes * gpu.usable_memory // model.expert_column_bytes)
    need = min_replicas * model.experts
    step_client = client_busy(model, gpu, wl, attention_perf(model, gpu), rows)

    def step(placement: Placement, alive: list[bool]) -> float:
        busiest = max(server_times(model, gpu, placement, load, fleet_rows, alive))
        return max(step_client, busiest) + sync_time(model, gpu)

    def fits(servers: int) -> tuple[Placement, float] | None:
        placement = _placed(placed, servers, math.ceil(need / servers), min_replicas)
        if min(placement.replicas) < min_replicas:
            return None
        alive = [True] * servers
        t = step(placement, alive)
        if spare:
            alive[max(range(servers), key=lambda s: placement.server_load[s])] = False
            if step(placement, alive) > wl.tpot_slo_s:
                return None
        return (placement, t) if t <= wl.tpot_slo_s else None

    # the busiest server's time falls as servers are added (fewer slots, fewer pairs each): gallop
    # up to a count that fits, then bisect
    # past one slot per server, more servers hold more replicas of the hot experts (EPLB's
    # replication); the cap only stops a search that cannot succeed
    lo = max(min_replicas, math.ceil(need / per_server))
    cap = 64 * need
    hi = lo
    while fits(hi) is None:
        if hi >= cap:
            raise ValueError(
                f"no EaaS expert pool of {model.name} meets TPOT {wl.tpot_slo_s}s for {fleet_rows} tokens"
            )
        lo, hi = hi + 1, min(2 * hi, cap)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    placement, t = fits(lo)
    return lo, placement, t


def plan_monolithic(group: GroupPlan, tokens_per_s: float) -> int:
    """GPUs for `tokens_per_s`: whole groups."""
    return group.gpus_per_group * max(1, math.ceil(tokens_per_s / group.tokens_per_s))


# -- a day of load and a failure --------------------------------------------------------------------


def diurnal(peak: float, hours: float = 24.0, interval_s: float = 600.0, trough: float = 0.2) -> list[float]:
    """Demand per interval over a day: a cosine between `trough` x peak (at 04:00) and peak (16:00)."""
    n = int(hours * 3600 / interval_s)
    out = []
    for i in range(n):
        h = (i + 0.5) * interval_s / 3600
        out.append(peak * (trough + (1 - trough) * 0.5 * (1 - math.cos(2 * math.pi * (h - 4) / 24))))
    return out


def gpu_hours(
    model: MoEModel, gpu: GPU, wl: Workload, demand: Sequence[float], interval_s: float, group_gpus: int,
    min_replicas: int = 2,
    spare: bool = False,
    loads: Sequence[Sequence[float]] | None = None,
    replace_every: int | None = 1,
) -> dict:  # fmt: skip
    """Both fleets autoscaled per interval to each interval's demand (tokens/s). `loads`: the
    per-expert load of each interval (default: one fixed load all day). Both fleets place their
    experts from the loads measured in the interval before a re-placement, every `replace_every`
    intervals (None: once, at the start of the day), and serve each interval's own load."""
    loads = (
        [tuple(x) for x in loads] if loads is not None else [tuple(expert_loads(model.experts))] * len(demand)
    )
    mono, eaas, skews = [], [], []
    for i, d in enumerate(demand):
        at = 0 if replace_every is None else i - i % replace_every
        placed_on = loads[max(0, at - 1)]
        group = monolithic_group(model, gpu, wl, group_gpus, loads[i], placed_on)
        mono.append(plan_monolithic(group, d))
        skews.append(group.imbalance)
        eaas.append(plan_eaas(model, gpu, wl, d, min_replicas, loads[i], spare, placed_on).gpus)
    h = interval_s / 3600
    return {
        "group": group,
        "monolithic_imbalance": skews,
        "monolithic_gpus": mono,
        "eaas_gpus": eaas,
        "monolithic_gpu_hours": sum(mono) * h,
        "eaas_gpu_hours": sum(eaas) * h,
        "saving": 1 - sum(eaas) / sum(mono),
    }


def failure_timeline(
    model: MoEModel,
    gpu: GPU,
    wl: Workload,
    tokens_per_s: float,
    group_gpus: int,
    fail_at_s: float = 60.0,
    recover_after_s: float = 300.0,
    duration_s: float = 600.0,
    bin_s: float = 10.0,
    min_replicas: int = 2,
    spare: bool = False,
) -> dict:
    """Decode throughput over time, step by step on the event loop, for both fleets sized for
    `tokens_per_s` with one GPU failing at `fail_at_s` for `recover_after_s`: in the monolithic fleet
    it halts its group (the rows in flight there are lost), in EaaS it is an expert server whose
    experts' pairs go to their other replicas. Each unit serves its share of the demand, up to its
    rows: by Little's law a step of s seconds needs demand x s / units rows in flight, so a slower
    step costs throughput only once it needs more rows than the unit holds."""
    load = tuple(expert_loads(model.experts))
    group = monolithic_group(model, gpu, wl, group_gpus, load)
    groups = max(1, math.ceil(tokens_per_s / group.tokens_per_s))
    plan = plan_eaas(model, gpu, wl, tokens_per_s, min_replicas, load, spare)
    attn = attention_perf(model, gpu)
    bins = int(duration_s / bin_s)
    out: dict = {"bin_s": bin_s, "groups": groups, "eaas": plan, "group": group}

    # monolithic: each group steps at its planned step time unless halted
    loop = EventLoop()
    mono = [0.0] * bins
    group_rows = group.rows_per_gpu * group.gpus_per_group

    def group_step(g: int) -> None:
        now = loop.now
        failed = fail_at_s <= now < fail_at_s + recover_after_s
        if g == 0 and failed:
            loop.at(fail_at_s + recover_after_s, group_step, g)  # halted: restarts empty
            return
        b = int(now // bin_s)
        if b < bins and now > 0:
            live = groups - 1 if failed else groups
            mono[b] += min(group_rows, tokens_per_s / live * group.step_s)
        loop.after(group.step_s, group_step, g)

    for g in range(groups):
        loop.at(g * group.step_s / groups, group_step, g)
    loop.run(until=duration_s)

    # EaaS: clients step at the slower of their own step and the busiest live server's
    loop = EventLoop()
    eaas = [0.0] * bins
    alive = [True] * plan.servers
    victim = max(range(plan.servers), key=lambda s: plan.placement.server_load[s])  # the worst case
    client_step = client_busy(model, gpu, wl, attn, plan.rows_per_client)
    fleet_rows = wl.step_tokens(plan.clients * plan.rows_per_client)

    def step_time() -> float:
        busiest = max(server_times(model, gpu, plan.placement, load, fleet_rows, alive))
        return max(client_step, busiest) + sync_time(model, gpu)

    state = {"step": step_time()}
    normal = state["step"]

    def set_alive(flag: bool) -> None:
        alive[victim] = flag
        state["step"] = step_time()
        if not flag:
            state["degraded"] = state["step"]

    def client_step_event(c: int) -> None:
        now = loop.now
        b = int(now // bin_s)
        if b < bins and now > 0:
            eaas[b] += min(plan.rows_per_client, tokens_per_s / plan.clients * state["step"])
        loop.after(state["step"], client_step_event, c)

    loop.at(fail_at_s, set_alive, False)
    loop.at(fail_at_s + recover_after_s, set_alive, True)
    for c in range(plan.clients):
        loop.at(c * state["step"] / plan.clients, client_step_event, c)
    loop.run(until=duration_s)

    mono_tps = [x / bin_s for x in mono]
    eaas_tps = [x / bin_s for x in eaas]
    out.update(
        monolithic_tokens_per_s=mono_tps,
        eaas_tokens_per_s=eaas_tps,
        monolithic_dip=_dip(mono_tps, bin_s, fail_at_s, recover_after_s),
        eaas_dip=_dip(eaas_tps, bin_s, fail_at_s, recover_after_s),
        eaas_step_s=normal,
        eaas_degraded_step_s=state.get("degraded", normal),
    )
    return out


def _dip(series: Sequence[float], bin_s: float, fail_at_s: float, recover_after_s: float) -> float:
    """1 - throughput during the failure over throughput before it (whole bins only)."""
    before = [x for i, x in enumerate(series) if i >= 1 and (i + 1) * bin_s <= fail_at_s]
    during = [
        x
        for i, x in enumerate(series)
        if i * bin_s >= fail_at_s and (i + 1) * bin_s <= fail_at_s + recover_after_s
    ]
    if not before or not during:
        return 0.0
    return 1 - (sum(during) / len(during)) / (sum(before) / len(before))


__all__ = [
    "DEEPSEEK_V3", "GPU", "H100", "MIXTRAL_8X22B", "MODELS", "EaaSPlan", "ExpertUnavailable", "GroupPlan",
    "MoEModel", "Workload", "attention_perf", "diurnal", "drifting_loads", "expert_loads", "expert_perf",
    "failure_timeline", "gpu_hours", "imbalance", "monolithic_group", "plan_eaas", "plan_monolithic",
]  # fmt: skip
