"""Expert-as-a-Service at fleet scale: an MoE model's decode served either by monolithic
expert-parallel groups (every GPU of a group runs attention for its rows and holds 1/G of the routed
experts; the group scales, and fails, as one unit) or by EaaS (attention clients that keep the
dense weights and the KV cache, and stateless expert servers that hold replicated experts; each pool
scales one GPU at a time, and a failed expert server's rows go to the replicas of its experts).

Step times use the `PerfModel` form, derived from the model's shapes and a GPU's roofline (weights
read once per step, a per-row cost, KV read per context token), not fitted: there are no GPU
measurements of either layout here. With two micro-batches in flight (the paper's double batching,
DeepSeek's two-micro-batch overlap) a step takes the longest of its compute and its all-to-all
traffic; in a monolithic group each GPU computes attention and experts one after the other, in EaaS
on different GPUs. `plan_monolithic` / `plan_eaas` size a fleet for a decode token rate under a
time-per-output-token SLO; `failure_timeline` runs the fleets step by step on the event loop through
a failure. Placement is the live one (`cluster.expert_placement.place_experts`, EPLB's policy).
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
        """What one decode row sends to and gets back from its experts in one step."""
        return self.top_k * self.hidden * (self.dispatch_bytes + self.combine_bytes) * self.moe_layers


# DeepSeek-V3: deepseek-ai/DeepSeek-V3 config.json (61 layers, first_k_dense_replace 3, hidden 7168,
# 256 routed experts, top-8, moe_intermediate_size 2048, MLA kv_lora_rank 512 + rope 64), FP8 weights
# as released; 671B parameters in all (the technical report), of which the routed experts are
# 256 x 58 x 3 x 7168 x 2048; the MLA cache in bf16.
DEEPSEEK_V3 = MoEModel(
    "deepseek-v3", layers=61, moe_layers=58, hidden=7168, experts=256, top_k=8, expert_ffn=2048,
    dense_params=671e9 - 256 * 58 * 3 * 7168 * 2048, weight_bytes=1.0, kv_bytes_per_token=61 * 576 * 2,
    source="deepseek-ai/DeepSeek-V3 config.json; 671B total (DeepSeek-V3 technical report); FP8 weights",
)  # fmt: skip
# Mixtral-8x22B: mistralai/Mixtral-8x22B-v0.1 config.json (56 layers, hidden 6144, 8 experts, top-2,
# intermediate 16384, 8 KV heads of 128); 141B parameters (Mistral's announcement); bf16.
MIXTRAL_8X22B = MoEModel(
    "mixtral-8x22b", layers=56, moe_layers=56, hidden=6144, experts=8, top_k=2, expert_ffn=16384,
    dense_params=141e9 - 8 * 56 * 3 * 6144 * 16384, weight_bytes=2.0, kv_bytes_per_token=56 * 2 * 8 * 128 * 2,
    dispatch_bytes=2.0, source="mistralai/Mixtral-8x22B-v0.1 config.json; 141B total; bf16",
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
    """One GPU's attention and dense part of a decode step: its dense weights read once, a row's
    dense FLOPs, each context token's KV read."""
    bw = gpu.hbm_bytes_per_s * gpu.memory_efficiency
    return PerfModel(
        name=f"{model.name}-{gpu.name}-attention",
        base_s=model.dense_bytes / bw + model.layers * gpu.layer_overhead_s,
        decode_row_s=2 * model.dense_params / (gpu.flops * gpu.compute_efficiency),
        decode_attention_s=model.kv_bytes_per_token / bw,
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
    return rows * model.row_wire_bytes / gpu.net_bytes_per_s


@dataclass(frozen=True, slots=True)
class Workload:
    """Decode demand and its SLO: mean context per running row and the time per output token."""

    context_tokens: float = 2048
    tpot_slo_s: float = 0.05


def expert_loads(experts: int, skew: float = 0.6, seed: int = 0) -> list[float]:
    """Per-expert routed load after load balancing: 1 + skew * u, u uniform (max/min <= 1 + skew)."""
    import random

    rng = random.Random(seed)
    return [1.0 + skew * rng.random() for _ in range(experts)]


# -- monolithic expert-parallel groups -----------------------------------------------------------------


@dataclass(frozen=True)
class GroupPlan:
    gpus_per_group: int
    rows_per_gpu: int  # decode rows each GPU runs at the SLO (its KV room or the step time binds)
    step_s: float
    tokens_per_s: float  # one group's decode throughput at the SLO
    imbalance: float  # busiest GPU's expert load over the mean


def monolithic_group(
    model: MoEModel, gpu: GPU, wl: Workload, gpus: int, load: Sequence[float] | None = None
) -> GroupPlan:
    """The largest batch per GPU of a G-GPU expert-parallel group that meets the TPOT SLO and fits
    in memory (dense weights on every GPU, 1/G of the routed experts, the rest KV)."""
    load = load if load is not None else expert_loads(model.experts)
    columns = math.ceil(model.experts / gpus)
    placement = place_experts(load, gpus, columns)
    free = gpu.memory_bytes * gpu.usable_memory - model.dense_bytes - columns * model.expert_column_bytes
    if free <= 0:
        raise ValueError(f"{gpus} GPUs cannot hold {model.name}")
    kv_rows = int(free // (model.kv_bytes_per_token * wl.context_tokens))
    attn = attention_perf(model, gpu)
    experts = expert_perf(model, gpu, columns)
    best = None
    for rows in range(1, kv_rows + 1):
        step = monolithic_step(model, gpu, wl, attn, experts, placement, gpus, rows)
        if step > wl.tpot_slo_s:
            break
        best = (rows, step)
    if best is None:
        raise ValueError(f"a {gpus}-GPU group of {model.name} cannot meet TPOT {wl.tpot_slo_s}s")
    rows, step = best
    return GroupPlan(gpus, rows, step, gpus * rows / step, placement.imbalance)


def monolithic_step(
    model: MoEModel,
    gpu: GPU,
    wl: Workload,
    attn: PerfModel,
    experts: PerfModel,
    placement: Placement,
    gpus: int,
    rows: int,
) -> float:
    """Attention then experts on the same GPU; the all-to-all overlapped with them."""
    slots = rows * model.top_k * placement.imbalance  # the busiest GPU's pairs: G x rows x k over G
    compute = attn.decode_step_time(rows, round(rows * wl.context_tokens)) + experts.step_time(
        StepShape.decode(round(slots), 0)
    )
    return max(compute, wire_time(model, gpu, rows * (gpus - 1) / gpus)) + sync_time(model, gpu)


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
    """An attention client's own part of a step: its compute or its rows' expert traffic, overlapped."""
    return max(attn.decode_step_time(rows, round(rows * wl.context_tokens)), wire_time(model, gpu, rows))


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
    """Each live server's time per step for `rows` decode rows in the fleet: its slots' weights read
    once, its share of the (token, expert) pairs computed and received. An expert's pairs split evenly
    over its live replicas."""
    live = [0] * len(load)
    for s, held in enumerate(placement.servers):
        if alive[s]:
            for e in held:
                live[e] += 1
    if not all(live):
        raise ExpertUnavailable(f"experts {[e for e, n in enumerate(live) if not n]} have no live replica")
    pairs = rows * model.top_k / sum(load)
    flops = model.slot_flops / (gpu.flops * gpu.compute_efficiency)
    wire = (
        model.hidden * (model.dispatch_bytes + model.combine_bytes) * model.moe_layers / gpu.net_bytes_per_s
    )
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
) -> EaaSPlan:
    """The fewest GPUs (clients + servers) that decode `tokens_per_s` within the TPOT SLO: clients
    from their rows per step; servers the smallest count whose slowest server keeps up, every expert
    held `min_replicas` times (so a failed server leaves a replica). With `spare`, the SLO must also
    hold with the busiest server down."""
    load = tuple(load) if load is not None else tuple(expert_loads(model.experts))
    rows = client_rows(model, gpu, wl)
    clients = max(1, math.ceil(tokens_per_s * wl.tpot_slo_s / rows))  # rows / step >= rows / SLO
    servers, placement, step = _expert_pool(model, gpu, wl, rows, clients, min_replicas, load, spare)
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
) -> tuple[int, Placement, float]:
    """Expert servers for `clients` attention clients of `rows` rows each: (count, placement, step)."""
    fleet_rows = rows * clients
    per_server = int(gpu.memory_bytes * gpu.usable_memory // model.expert_column_bytes)
    need = min_replicas * model.experts
    step_client = client_busy(model, gpu, wl, attention_perf(model, gpu), rows)

    def step(placement: Placement, alive: list[bool]) -> float:
        busiest = max(server_times(model, gpu, placement, load, fleet_rows, alive))
        return max(step_client, busiest) + sync_time(model, gpu)

    def fits(servers: int) -> tuple[Placement, float] | None:
        placement = place_experts(load, servers, math.ceil(need / servers))
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
    lo = max(min_replicas, math.ceil(need / per_server))
    hi = lo
    while fits(hi) is None:
        if hi >= need:
            raise ValueError(
                f"no EaaS expert pool of {model.name} meets TPOT {wl.tpot_slo_s}s for {fleet_rows} rows"
            )
        lo, hi = hi + 1, min(2 * hi, need)
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
) -> dict:  # fmt: skip
    """Both fleets autoscaled per interval to each interval's demand (tokens/s)."""
    load = expert_loads(model.experts)
    group = monolithic_group(model, gpu, wl, group_gpus, load)
    mono = [plan_monolithic(group, d) for d in demand]
    eaas = [plan_eaas(model, gpu, wl, d, min_replicas, load, spare).gpus for d in demand]
    h = interval_s / 3600
    return {
        "group": group,
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
    load = expert_loads(model.experts)
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
    fleet_rows = plan.clients * plan.rows_per_client

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
    "MoEModel", "Workload", "attention_perf", "diurnal", "expert_loads", "expert_perf", "failure_timeline",
    "gpu_hours", "monolithic_group", "plan_eaas", "plan_monolithic",
]  # fmt: skip
