"""Mixed-length training with hot switching (HotSPa's job, without its defects).

One `Trainer.step(global_batch)`:
1. splits the batch's sequences into length buckets and packs each bucket's rows (`data`);
2. gives each bucket a config: the user's, or the cost model's choice (`cost_model`), which
   profiles each config at each bucket length once and keeps to a per-rank memory budget;
3. visits the configs in the planner's cheapest cycle from the base config (`order`): in each it
   runs its buckets' micro-batches, accumulating gradients weighted by their target-token counts,
   and switches weights and accumulated gradients to the next; back in the base it adds the base's
   own buckets and runs AdamW on the fp32 masters, which, with the optimizer states, live only in
   the base config (optionally ZeRO-1 sharded over the base's data-parallel ranks).

The step equals a single-device AdamW step on the same global batch with loss = mean next-token
cross-entropy over all of the batch's target tokens.
"""
from __future__ import annotations

import copy
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hotswitch.compiler.memory import estimate_peak_bytes
from hotswitch.distconfig import DistConfig, Topology, parse_configs
from hotswitch.distributed.device import comm_tensor, runtime_device, synchronize
from hotswitch.kernels import cast
from hotswitch.models import PackedCausalLMLoss, document_ids_of
from hotswitch.runtime import weights as W
from hotswitch.runtime.compiled_model import CompiledModel
from hotswitch.runtime.compiled_model import compile as hs_compile
from hotswitch.search.auto import auto_configs
from hotswitch.search.comm import CommProfile, compiled_comm_profile
from hotswitch.search.space import default_base
from hotswitch.switch.order import OrderPlan, plan_order
from hotswitch.switch.state import JOB_STATE, StateKind, state_key
from hotswitch.train import data as D
from hotswitch.train.cost_model import Base, BucketDemand, CostModel, Probe, SwitchProbe


@dataclass(frozen=True)
class BucketReport:
    lengths: tuple[int, int]  # (low, high]: sequence lengths in the bucket
    config: str
    sequences: int
    micro_batches: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class SwitchReport:
    source: str
    destination: str
    bytes: int  # sent by all ranks together
    seconds: float  # exposed: the slowest rank's wait in the switch itself
    with_grads: bool
    overlapped_seconds: float = 0.0  # the slowest rank's weight move in the background (prefetch)
    handed_off_bytes: int = 0  # gradients sent during the backward that made them final (all ranks)


@dataclass(frozen=True)
class StepReport:
    step: int
    loss: float  # mean next-token cross-entropy over the batch's target tokens
    tokens: int  # tokens of the global batch
    target_tokens: int
    seconds: float  # the whole step (profiling and first-use compilation excluded, reported apart)
    buckets: tuple[BucketReport, ...]
    switches: tuple[SwitchReport, ...]
    optimizer_seconds: float
    profile_seconds: float = 0.0
    compile_seconds: float = 0.0
    base: str = ""  # the config holding the masters and the optimizer, where the step ends

    @property
    def switch_seconds(self) -> float:
        """Exposed switching: what the step waited for (prefetched weights moved meanwhile)."""
        return sum(s.seconds for s in self.switches)

    @property
    def overlapped_switch_seconds(self) -> float:
        return sum(s.overlapped_seconds for s in self.switches)

    @property
    def handed_off_bytes(self) -> int:
        """Gradients sent during the backward that made them final (all ranks)."""
        return sum(s.handed_off_bytes for s in self.switches)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf

    @property
    def switch_share(self) -> float:
        """Fraction of the step spent switching."""
        return self.switch_seconds / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """One log line: loss, throughput, switching, config per bucket."""
        buckets = " ".join(f"({b.lengths[0]},{b.lengths[1]}]:{b.config}x{b.micro_batches}" for b in self.buckets)
        return (
            f"step {self.step} loss {self.loss:.4f} tokens {self.tokens} {self.tokens_per_second:,.0f} tok/s "
            f"step {self.seconds:.3f}s switch {self.switch_seconds:.3f}s ({100 * self.switch_share:.1f}%, "
            f"{self.overlapped_switch_seconds:.3f}s overlapped) {buckets}"
        )


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    @classmethod
    def from_dict(cls, spec: dict | None) -> AdamWConfig:
        spec = dict(spec or {})
        name = spec.pop("name", "adamw")
        if str(name).lower() != "adamw":
            raise ValueError(f"optimizer {name!r} is not supported; use dict(name='adamw', lr=..., betas=..., "
                             "eps=..., weight_decay=...)")
        unknown = set(spec) - {"lr", "betas", "eps", "weight_decay"}
        if unknown:
            raise ValueError(f"unknown AdamW options {sorted(unknown)}; accepted: lr, betas, eps, weight_decay")
        if "betas" in spec:
            spec["betas"] = tuple(spec["betas"])
        return cls(**spec)


class Trainer:
    """Hot-switched mixed-length training of a causal LM on the current process group.

    `model`: a causal LM whose forward takes `input_ids` (and `position_ids`, `attention_mask`) and
    returns logits or an object with `.logits` (e.g. a Hugging Face `LlamaForCausalLM`), with the
    same weights on every rank. `configs`: DistConfigs (or "dp=2,tp=2" strings) over all ranks, or
    "auto": measure a few configs and let `hotswitch.search` choose the set (`self.search` says why).
    `memory_budget_bytes`: per-rank cap on the estimated peak (None: no cap).

    Options: `base` (config holding masters and optimizer; default: chosen with the first step's
    assignment, the config whose cycle costs least with the optimizer's memory counted, so a step
    whose buckets all run under one config does not switch),
    `buckets` (length bounds; default from the first batch's length distribution, `num_buckets`
    of them, default max(3, number of configs)), `bucket_configs` (one config name per bucket, skipping the cost model),
    `micro_batch_tokens` (tokens per data-parallel replica per micro-batch), `compute_dtype`
    (default bfloat16 on GPU, float32 on CPU), `zero1` (shard optimizer states over the base's dp ranks;
    default: off, unless a chosen base needs it to fit the budget, or the search's choice under "auto"),
    `prefetch` (default on: while a config computes, the weights of the step's next config move in
    the background, within the memory budget; and a config's gradients leave for the next config's
    layout during its last backward, bucket by bucket as they become final),
    `progress(message)` for long phases, `strict`
    (default False: an op DTensor cannot shard at some micro-batch shape, e.g. GQA's head
    regrouping with one row under tp > kv heads, runs replicated with a warning instead of failing;
    results stay exact), `logic` (the LogicGraph of an
    earlier Trainer of the same model: skips tracing), `cp_layout` (see `hs.compile`), `backend`
    ("eager", or "inductor": every ExecGraph compiled by Inductor on its first step; "auto"'s
    measurements run eagerly), `grad_bucket_bytes` (see `hs.compile`), `weights` (see `hs.compile`:
    for a model built on the meta device, "init", an init function or a checkpoint path; the fp32
    masters are read or initialized shard-wise in the base layout). Call `step` with the same global
    batch on every rank.
    """

    def __init__(self, model: nn.Module, configs, optimizer: dict | None = None, memory_budget_bytes: int | None = None,
                 *, base: str | None = None, buckets: Sequence[int] | None = None, num_buckets: int | None = None,
                 bucket_configs: Sequence[str] | None = None, micro_batch_tokens: int = 2048,
                 compute_dtype: torch.dtype | None = None, zero1: bool | None = None, length_multiple: int = 16,
                 profile_repeats: int = 3, strict: bool = False, topology: Topology | None = None,
                 progress: Callable[[str], None] | None = None, logic=None, prefetch: bool = True,
                 cp_layout: str = "contiguous", backend: str = "eager", grad_bucket_bytes: int | None = None,
                 weights=None):
        rng = torch.get_rng_state()  # weights="init" draws from here
        if not dist.is_initialized():
            raise RuntimeError("hotswitch.Trainer needs torch.distributed: call dist.init_process_group first "
                               "(gloo on CPU, nccl on GPU) on every rank, or use `hotswitch train`")
        W.check_source(weights, model)  # a meta model without weights fails before anything runs
        self.search = None  # configs="auto": the search that chose them (hotswitch.search.SearchResult)
        if isinstance(configs, str) and configs == "auto":
            meters = []  # a Trainer of the space, to calibrate on; its LogicGraph is reused below

            def measure(space, timed, lengths):  # every config of the space, compiled only where read
                meter = Trainer(model, space, memory_budget_bytes=memory_budget_bytes, logic=logic,
                                micro_batch_tokens=micro_batch_tokens, compute_dtype=compute_dtype,
                                length_multiple=length_multiple, strict=strict, topology=topology, progress=progress,
                                grad_bucket_bytes=grad_bucket_bytes, weights=None if weights is None else W.EMPTY)
                meters.append(meter)
                timed = [c.name for c in timed]
                meter.profile(lengths, configs=timed)
                return (list(meter.cost.probes.values()), meter.measure_switches(timed),
                        meter.comm_profiles(lengths[0]))

            configs, self.search = auto_configs(
                model, measure, memory_budget_bytes=memory_budget_bytes, lengths=buckets, topology=topology,
                micro_batch_tokens=micro_batch_tokens, length_multiple=length_multiple, zero1=zero1,
                compute_dtype=compute_dtype, progress=progress)
            logic = meters[0].cm.logic if meters else logic
            del meters
            zero1 = self.search.zero1 if zero1 is None else zero1
            base = base or self.search.base  # the search priced its cycles and memory from that base
        self.configs = tuple(parse_configs(configs))  # DistConfigs or strings, "dp2tp2sp" or "dp=2,tp=2,sp"
        names = [c.name for c in self.configs]
        piped = [c.name for c in self.configs if c.pp > 1]
        if piped:
            raise ValueError(f"configs {piped} have pp > 1: the Trainer runs pp = 1 configs (DP, TP, SP); pipeline "
                             "configs train through CompiledModel.forward_backward(..., micro_batches=k)")
        if base is not None and base not in names:
            raise ValueError(f"base config {base!r} is not among the configs {names}")
        # until the first step chooses one (`_choose`): the most model-parallel config, which needs
        # the least memory for the optimizer
        self.base = base or default_base(self.configs).name
        self._base_fixed = base is not None
        self._zero1_given = zero1 is not None
        self.adamw = AdamWConfig.from_dict(optimizer)
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
        self.micro_batch_tokens = micro_batch_tokens
        # (an fsdp base's optimizer state is sharded over its dp ranks already: ZeRO-1 has nothing to split)
        self.zero1 = bool(zero1) and not next(c for c in self.configs if c.name == self.base).fsdp
        self.prefetch = prefetch
        self.profile_repeats = profile_repeats
        # every sequence shard whole; zigzag cuts every row into 2 x cp chunks
        per_shard = 2 if cp_layout == "zigzag" else 1
        self.length_multiple = math.lcm(length_multiple, *(per_shard * c.sequence_shards for c in self.configs))
        self._report = progress or (lambda message: None)
        self._num_buckets = num_buckets or max(3, len(self.configs))
        self._boundaries: tuple[int, ...] | None = None
        if buckets is not None:
            self._boundaries = tuple(sorted({int(b) for b in buckets}))
            if bucket_configs is not None and len(bucket_configs) != len(self._boundaries):
                raise ValueError(
                    f"bucket_configs names {len(bucket_configs)} configs for {len(self._boundaries)} buckets "
                    f"{self._boundaries}: give one config per bucket"
                )
        elif bucket_configs is not None:
            raise ValueError("bucket_configs needs explicit `buckets` (one config per bucket bound)")
        for name in bucket_configs or ():
            if name not in names:
                raise ValueError(f"bucket_configs names {name!r}, which is not among the configs {names}")
        self.bucket_configs = tuple(bucket_configs) if bucket_configs is not None else None

        # GPUs train in bf16 with fp32 masters and fp32 gradient accumulators; CPUs default to fp32
        self.compute_dtype = compute_dtype or (torch.bfloat16 if runtime_device().type == "cuda" else torch.float32)
        first_param = next(model.parameters())
        masters_fp32 = {n: p.detach().float() for n, p in model.named_parameters(remove_duplicate=False)} \
            if weights is None else None  # else read shard-wise below, in fp32 (`load_weights`)
        user_model = model
        if first_param.dtype != self.compute_dtype:
            model = copy.deepcopy(model).to(self.compute_dtype)
        self.vocab_size = _vocab_size(model)
        self.loss_module = PackedCausalLMLoss(model)
        self.pack = self.loss_module.can_pack
        # cp configs may move tokens (zigzag, document-aware) when attention reads document ids
        self.documents = cp_layout != "contiguous"
        if self.documents and not self.loss_module.takes_documents:
            raise ValueError(f"cp_layout={cp_layout!r} needs a model whose forward takes document_ids (attention from "
                             f"ids and positions, as hotswitch.models.GPT): {type(model).__name__} does not; "
                             "use cp_layout='contiguous'")
        example = self._inputs(D.full_length_micro_batch(2, self.length_multiple))
        self.cm: CompiledModel = hs_compile(self.loss_module, example, self.configs, lazy=True, topology=topology,
                                            strict=strict, logic=logic, progress=self._report, cp_layout=cp_layout,
                                            backend=backend, grad_bucket_bytes=grad_bucket_bytes,
                                            weights=None if weights is None else W.EMPTY)
        self.cm.grad_dtype = torch.float32
        self.cost = CostModel(memory_budget_bytes)
        self.step_count = 0
        # Called on every rank as `on_phase(phase, step)` by an elastic driver (`hotswitch.elastic`):
        # "start" before the step's first collective (the check that every rank has the same batch)
        # and "checked" after it; "probe:<config>:<length>" when a profiling probe's graph is compiled
        # and its collectives begin; "compiled" when the step's graphs are compiled and its collectives
        # begin; "update" just before the optimizer changes anything (raising there leaves the
        # step-start state intact).
        self.on_phase: Callable[[str, int], None] | None = None
        if weights is None:
            self.cm.switch(self.base)
            self._init_optimizer(self.cm.shard_like_params(
                {n: masters_fp32[n.removeprefix("model.")] for n in self.cm.logic.param_names}))
        else:  # nothing was read yet: the base reads its fp32 masters' pieces, its compute weights cast from them
            dtypes = self.cm.logic.param_dtypes
            self.cm.switch(self.base, weights={n: torch.empty(s, dtype=dtypes[n], device=self.cm.device)
                                               for n, s in self.cm.local_shapes(self.base).items()})
            torch.set_rng_state(rng)
            self._init_optimizer(self.cm.load_weights(weights, user_model, dtype=torch.float32))

    # ------------------------------------------------------------------------------------ training
    def step(self, global_batch) -> StepReport:
        sequences = D.validate_batch(global_batch, self.vocab_size)
        self._phase("start")
        self._check_same_batch(sequences)
        self._phase("checked")
        lengths = [s.numel() for s in sequences]
        buckets = D.make_buckets(lengths, self.bucket_bounds(lengths)) if self.pack else self._unpacked(lengths)
        demands = [BucketDemand(b.high, len(b.rows)) for b in buckets]
        compile_before = self._compile_seconds()
        profile_seconds = 0.0
        if self.bucket_configs is None and len(self.configs) == 1 and self.memory_budget_bytes is None:
            chosen = [self.configs[0].name] * len(buckets)  # nothing to choose: no profiling
        elif self.bucket_configs is None:
            t0 = time.perf_counter()
            self.profile(sorted({d.length for d in demands}))
            profile_seconds = time.perf_counter() - t0
            chosen = self._choose(demands)
        else:
            chosen = self._choose(demands, [self.bucket_configs[self._boundaries.index(b.high)] for b in buckets])
        total_targets = D.target_tokens(lengths)
        if total_targets == 0:
            raise ValueError("the global batch has no next-token targets (every sequence has one token)")

        for k, bucket in enumerate(buckets):  # compile first use of a shape outside the timed step
            config = self.config(chosen[k])
            self._micro_batch_graph(config, bucket.high)
        compile_seconds = self._compile_seconds() - compile_before
        self._phase("compiled")

        t_step = time.perf_counter()
        order = self._step_order(frozenset(chosen), self.base)
        visits = list(order.order[1:]) + [self.base]
        loss = 0.0
        bucket_seconds = [0.0] * len(buckets)
        bucket_micro = [0] * len(buckets)
        switches = []
        # the base's weights do not change before the optimizer step: kept, the step's way back moves
        # only the gradients
        base_weights = self.cm.local_params
        # the base's own buckets run first, while the next config's weights move behind them; their
        # gradients wait in the base's layout and are added to the others' on the way back
        base_first = self.base in chosen and len(visits) > 1
        if base_first:
            visits = [self.base, *visits]
        base_grads, ran = None, set()
        for i, config in enumerate(visits):
            if config != self.cm.active:
                if base_first and self.cm.active == self.base and base_grads is None:
                    base_grads = self.cm.local_grads
                    self.cm.zero_grad()  # they stay here: nothing to move on the way out
                with_grads = self.cm.local_grads is not None
                stats = self.cm.switch(config, weights=base_weights if config == self.base else None)
                switches.append((stats.source, stats.destination, stats.bytes_sent, stats.seconds, with_grads,
                                 stats.overlapped_seconds, stats.handed_off_bytes))
            following = visits[i + 1] if i + 1 < len(visits) else self.base
            prefetching = following not in (config, self.base) and self._may_prefetch(config, following, buckets,
                                                                                     chosen)
            if prefetching:
                self.cm.prefetch(following)
            if config in ran:
                continue
            ran.add(config)
            mine = [k for k in range(len(buckets)) if chosen[k] == config]
            # a config hands its gradients off to the next config's layout during its last backward,
            # as they become final (the base's own buckets run first: their gradients stay)
            hand_off = following != config and not (base_first and config == self.base)
            for k in mine:
                bucket = buckets[k]
                t0 = time.perf_counter()
                rows = self.rows_per_micro_batch(self.config(config), bucket.high)
                bucket_micro[k] = math.ceil(len(bucket.rows) / rows)
                micro = list(D.weighted_micro_batches(sequences, bucket, rows, total_targets))
                for j, (mb, weight) in enumerate(micro):
                    if hand_off and k == mine[-1] and j == len(micro) - 1 and \
                            self._may_hand_off(config, following, bucket, prefetching):
                        self.cm.hand_off_grads(following)
                    local = self.cm.shard_inputs(*(x.to(self.cm.device) for x in self._inputs(mb.inputs)))
                    loss += float(self.cm.forward_backward(*local, grad_scale=weight)) * weight
                synchronize(self.cm.device)
                bucket_seconds[k] += time.perf_counter() - t0
        if base_grads is not None:
            self.cm.accumulate_grads(base_grads)
        assert self.cm.active == self.base
        self._phase("update")
        t0 = time.perf_counter()
        self._optimizer_step()
        synchronize(self.cm.device)
        optimizer_seconds = time.perf_counter() - t0
        seconds = time.perf_counter() - t_step
        self.step_count += 1

        # one agreement so every rank reports the same numbers: slowest rank's times, all ranks' bytes
        times = comm_tensor([seconds, optimizer_seconds, *bucket_seconds, *(s[3] for s in switches),
                             *(s[5] for s in switches)], torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        sent = comm_tensor([*(s[2] for s in switches), *(s[6] for s in switches)] or [0], torch.float64)
        dist.all_reduce(sent)
        times = times.tolist()
        nb = len(buckets)
        return StepReport(
            step=self.step_count,
            loss=loss,
            tokens=sum(lengths),
            target_tokens=total_targets,
            seconds=times[0],
            optimizer_seconds=times[1],
            buckets=tuple(
                BucketReport(
                    (b.low, b.high),
                    chosen[k],
                    len(b.sequences),
                    bucket_micro[k],
                    sum(lengths[i] for i in b.sequences),
                    times[2 + k],
                )
                for k, b in enumerate(buckets)
            ),
            switches=tuple(
                SwitchReport(s[0], s[1], int(sent[i]), times[2 + nb + i], s[4], times[2 + nb + len(switches) + i],
                             int(sent[len(switches) + i]))
                for i, s in enumerate(switches)
            ),
            profile_seconds=profile_seconds,
            compile_seconds=compile_seconds,
            base=self.base,
        )

    def _check_same_batch(self, sequences: list[torch.Tensor]) -> None:
        """Every rank must step on the same global batch: compare digests (one small all-gather)
        before any collective whose sizes depend on the batch, which would otherwise abort in gloo
        ("Received data size doesn't match") or hang. Raises on every rank, naming the first rank
        whose batch differs from rank 0's."""
        world = dist.get_world_size()
        mine = comm_tensor([D.batch_digest(sequences)], torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        differ = [r for r in range(1, world) if not torch.equal(everyone[r], everyone[0])]
        if differ:
            raise ValueError(
                f"step {self.step_count + 1}: rank {differ[0]} was given a different global batch than rank 0"
                f"{f' (ranks {differ} all differ)' if len(differ) > 1 else ''}; Trainer.step needs the same "
                "global batch (same sequences, same order) on every rank: seed the data order identically "
                "on all ranks (e.g. hotswitch.data.SampleOrder) or broadcast the batch from rank 0")

    @property
    def memory_budget_bytes(self) -> int | None:
        return self.cost.memory_budget_bytes

    @memory_budget_bytes.setter
    def memory_budget_bytes(self, value: int | None) -> None:
        """Change the per-rank budget; later steps choose configs under it (profiles are kept)."""
        self.cost.memory_budget_bytes = value

    def rows_per_micro_batch(self, config: DistConfig, length: int) -> int:
        """Rows of one micro-batch of config `config` at this bucket length (`data.rows_per_micro_batch`)."""
        return D.rows_per_micro_batch(config.dp, length, self.micro_batch_tokens)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights under the keys of the model's state_dict (a collective: every rank)."""
        full = self.cm.full_state_dict(params=self._master_shards())
        return {k.removeprefix("model."): v for k, v in full.items()}

    def save_pretrained(self, directory, config=None, *, max_shard_bytes: int = 2 << 30) -> None:
        """The fp32 masters as a Hugging Face checkpoint (`CompiledModel.save_pretrained`: each rank
        writes the tensors it gathered, no rank the whole model). A collective: every rank, between steps."""
        self.cm.save_pretrained(directory, config, params=self._master_shards(), max_shard_bytes=max_shard_bytes)

    def save_checkpoint(self, directory) -> None:
        """The fp32 masters as a torch.distributed.checkpoint under the model's `state_dict()` names
        (`weights=directory` loads it into any config). A collective: every rank, between steps."""
        from hotswitch.runtime.saving import save_checkpoint

        save_checkpoint(self.cm, directory, params=self._master_shards(), strip="model.")

    # -------------------------------------------------------------------------------- job state
    def job_state(self) -> dict[str, torch.Tensor]:
        """This rank's shards, in the base layout, of everything the next step depends on: the fp32
        masters ("param:NAME") and AdamW's moments ("exp_avg:NAME", "exp_avg_sq:NAME"; zeros before
        the first step); keys from `hotswitch.switch.state`. With `step_count` this is the whole
        training state between steps (gradient accumulators are empty then). The tensors are the
        live ones: copy before mutating."""
        self._require_unsharded_optimizer("job_state")
        out = {}
        for n in self._names:
            p = self._masters[n]
            st = self.optimizer.state.get(p, {})
            out[state_key(StateKind.PARAM, n)] = p.detach()
            for kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
                out[state_key(kind, n)] = st[kind.value] if kind.value in st else torch.zeros_like(p)
        return out

    def load_job_state(self, state: dict[str, torch.Tensor], step: int) -> None:
        """Install `job_state()`-shaped shards (this rank's, base layout) and the step counter: the
        inverse of `job_state`, bit for bit."""
        self._require_unsharded_optimizer("load_job_state")
        expected = {state_key(k, n) for n in self._names for k in JOB_STATE}
        if set(state) != expected:
            raise ValueError(f"load_job_state: missing {sorted(expected - set(state))[:3]}, unexpected "
                             f"{sorted(set(state) - expected)[:3]}")
        for n in self._names:
            p = self._masters[n]
            for kind in JOB_STATE:
                if tuple(state[state_key(kind, n)].shape) != tuple(p.shape):
                    raise ValueError(f"load_job_state: {state_key(kind, n)} has shape "
                                     f"{tuple(state[state_key(kind, n)].shape)}, this rank's shard under {self.base!r} "
                                     f"has {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(state[state_key(StateKind.PARAM, n)])
            self.optimizer.state.pop(p, None)
            if step > 0:  # torch's AdamW state: the step as a float32 scalar tensor, the two moments
                self.optimizer.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                           **{k.value: state[state_key(k, n)].clone()
                                              for k in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)}}
        self.cm.zero_grad()
        self.cm.set_local_params(self._compute_weights(self._master_shards()))
        self.step_count = step

    def full_job_state(self) -> dict[str, torch.Tensor]:
        """`job_state()` gathered to full tensors (a collective: every rank)."""
        assert self.cm.active == self.base
        local = self.job_state()
        out = {}
        for kind in JOB_STATE:
            full = self.cm.full_state_dict(canonical=True, params={n: local[state_key(kind, n)] for n in self._names})
            out.update({state_key(kind, n): t for n, t in full.items()})
        return out

    def _require_unsharded_optimizer(self, what: str) -> None:
        if self._dp_group is not None:
            raise ValueError(f"{what}: the optimizer states are ZeRO-1 chunks (zero1=True), which elastic changes do "
                             "not move yet; train with zero1=False")

    def _phase(self, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, self.step_count)

    # ----------------------------------------------------------------------------------- profiling
    def profile(self, lengths: Sequence[int], configs: Sequence[str] | None = None) -> list[Probe]:
        """Measure every config (or those named) at each length not yet profiled (a collective: every rank).

        Each config's ExecGraph for a micro-batch of that length is compiled; its peak memory per
        rank is estimated from the graph; configs within the budget are timed (forward+backward,
        median of `profile_repeats` runs after a warm-up, slowest rank). Starts and ends in the base.
        """
        named = self.configs if configs is None else [self.config(n) for n in configs]
        todo = [(c, L) for c in named for L in lengths if not self.cost.has(c.name, L)]
        if not todo:
            return []
        assert self.cm.local_grads is None, "profile between steps: it discards gradients"
        probes = []
        for config in named:
            for length in [L for c, L in todo if c is config]:
                if self.cm.active != config.name:
                    self.cm.switch(config.name)
                self._report(f"profiling {config.name} at length {length}")
                probes.append(self._probe(config, length))
                self.cost.add(probes[-1])
        self.cm.switch(self.base)
        return probes

    def measure_switches(self, names: Sequence[str] | None = None, repeats: int = 2) -> list[SwitchProbe]:
        """Time the switch between every ordered pair of this Trainer's configs (or those named),
        weights only as between steps (the fastest of `repeats`, the slowest rank each): what
        `configs="auto"` prices switches by. A collective: every rank. Ends in the base."""
        assert self.cm.local_grads is None, "measure switches between steps: gradients would move too"
        names = [c.name for c in self.configs] if names is None else list(names)
        best: dict[tuple[str, str], float] = {}
        for _ in range(repeats):
            for source, destination in itertools.permutations(names, 2):
                if self.cm.active != source:
                    self.cm.switch(source)
                dist.barrier()
                t0 = time.perf_counter()
                self.cm.switch(destination)
                synchronize(self.cm.device)
                took = comm_tensor([time.perf_counter() - t0], torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                best[(source, destination)] = min(best.get((source, destination), math.inf), float(took.item()))
        self.cm.switch(self.base)
        return [SwitchProbe(a, b, seconds) for (a, b), seconds in best.items()]

    def comm_profiles(self, length: int) -> dict[str, CommProfile]:
        """The collectives each config's ExecGraph issues for a micro-batch of rows of `length`
        tokens (lowered here if it was not yet): what `configs="auto"` prices communication by."""
        out = {}
        for config in self.configs:
            gm = self._micro_batch_graph(config, length)
            tokens = self.rows_per_micro_batch(config, length) // config.dp * length  # per replica
            out[config.name] = compiled_comm_profile(self.cm, config.name, gm, tokens)
        return out

    def _micro_batch_graph(self, config: DistConfig, length: int):
        """The ExecGraph of one micro-batch of rows of `length` tokens under `config` (lowered on first use)."""
        rows = self.rows_per_micro_batch(config, length)
        # input ids, positions, targets (and document ids)
        return self.cm.exec_graph(config.name, ((rows, length),) * (4 if self.documents else 3))

    def _probe(self, config: DistConfig, length: int) -> Probe:
        rows = self.rows_per_micro_batch(config, length)
        inputs = self._inputs(D.full_length_micro_batch(rows, length, seed=length))
        gm = self.cm.exec_graph(config.name, tuple(tuple(x.shape) for x in inputs))
        self._phase(f"probe:{config.name}:{length}")
        state = self.state_bytes(config.name)
        need = comm_tensor([state + estimate_peak_bytes(gm)], torch.float64)
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        peak = int(need.item())
        probe = Probe(config.name, length, rows, None, peak, state)
        if not probe.fits(self.memory_budget_bytes):
            return probe  # never run what would not fit
        local = self.cm.shard_inputs(*(x.to(self.cm.device) for x in inputs))
        times = []
        for i in range(self.profile_repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            self.cm.forward_backward(*local)
            synchronize(self.cm.device)
            if i:
                times.append(time.perf_counter() - t0)
        self.cm.zero_grad()
        seconds = comm_tensor([statistics.median(times)], torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return Probe(config.name, length, rows, float(seconds.item()), peak, state)

    def state_bytes(self, name: str, base: Base | None = None) -> int:
        """Resident bytes per rank while config `name` runs (the largest over ranks): its compute
        weights and fp32 gradient accumulators, plus what the base (`base`, default this Trainer's)
        keeps throughout the step in its own layout: AdamW's two moments and the fp32 masters (split
        over the base's dp ranks with ZeRO-1; with fp32 compute and no ZeRO-1 the masters are the
        base's weights), and away from the base its compute weights (the step's way back reuses
        them) and the fp32 gradients of its own buckets (see `step`)."""
        base = base or Base(self.base, self.zero1)
        zero1 = base.zero1 and self.config(base.config).dp > 1
        split = self.config(base.config).dp if zero1 else 1
        masters_are_weights = self.compute_dtype == torch.float32 and not zero1
        optimizer = (2 * 4 + (0 if masters_are_weights else 4)) / split
        # away from the base: its compute weights (for the way back) and its buckets' fp32 gradients
        kept = 0 if name == base.config else (0 if masters_are_weights else self.compute_dtype.itemsize) + 4
        itemsize = self.compute_dtype.itemsize
        here, there = self.cm.layouts(name), self.cm.layouts(base.config)
        per_device = [0.0] * dist.get_world_size()
        for n, layout in here.items():
            for d in range(len(per_device)):
                per_device[d] += layout.numel(d) * (itemsize + 4) + there[n].numel(d) * (optimizer + kept)
        return int(max(per_device))

    def weight_bytes(self, name: str) -> int:
        """This config's compute weights per rank (the largest over ranks): what a prefetch into it adds."""
        return self._shard_bytes(name, self.compute_dtype.itemsize)

    def grad_bytes(self, name: str) -> int:
        """This config's fp32 gradient accumulators per rank (the largest over ranks)."""
        return self._shard_bytes(name, 4)

    def _shard_bytes(self, name: str, itemsize: int) -> int:
        """A value per parameter in config `name`'s layout, `itemsize` bytes each: the largest rank's bytes."""
        layouts = self.cm.layouts(name).values()
        return max(sum(layout.numel(d) for layout in layouts) * itemsize for d in range(dist.get_world_size()))

    def _may_prefetch(self, config: str, following: str, buckets, chosen: list[str]) -> bool:
        """Whether `following`'s weights may move while `config` runs its buckets: asked for, and
        within the budget with both layouts of the weights held (every bucket's profiled peak)."""
        if not self.prefetch:
            return False
        budget = self.memory_budget_bytes
        if budget is None:
            return True
        extra = self.weight_bytes(following)
        state = self.state_bytes(config)
        probes = [self.cost.probes.get((config, b.high)) for k, b in enumerate(buckets) if chosen[k] == config]
        return all(p is not None and p.peak_with(state) + extra <= budget for p in probes)

    def _may_hand_off(self, config: str, following: str, bucket, prefetching: bool) -> bool:
        """Whether `config`'s gradients may leave for `following`'s layout during its last backward
        (the micro-batch of `bucket`): asked for (`prefetch`), and within the budget with what the
        hand-off holds meanwhile, at most the gradients in both layouts (packed sends, posted
        receives), besides the weights of a prefetch into `following` (`prefetching`)."""
        if not self.prefetch:
            return False
        budget = self.memory_budget_bytes
        if budget is None:
            return True
        extra = self.grad_bytes(config) + self.grad_bytes(following) + (self.weight_bytes(following) if prefetching
                                                                         else 0)
        probe = self.cost.probes.get((config, bucket.high))
        return probe is not None and probe.peak_with(self.state_bytes(config)) + extra <= budget

    # ------------------------------------------------------------------------------------ internals
    def config(self, name: str) -> DistConfig:
        """The DistConfig called `name` among this Trainer's configs."""
        for c in self.configs:
            if c.name == name:
                return c
        raise ValueError(f"unknown config {name!r}; this Trainer's configs are {[c.name for c in self.configs]}")

    def _compile_seconds(self) -> float:
        return sum(self.cm.compile_seconds(c.name) for c in self.configs)

    def _cycle_seconds(self, used: frozenset[str], base: str | None = None) -> float:
        return self._step_order(used, base or self.base).cost

    def _step_order(self, used: frozenset[str], base: str) -> OrderPlan:
        """The step's cheapest cycle through `used` from `base`, priced by its exposed switching: the
        first switch moves the weights (prefetched behind the base's own buckets when it has some),
        the others the gradients (the weights were prefetched, or on the way back kept)."""
        names = sorted(used | {base}, key=[c.name for c in self.configs].index)

        def price(a: str, b: str, first: bool) -> float:
            if first:  # hidden behind the base's own buckets when it has some (see `step`)
                return 0.0 if self.prefetch and base in used else self.cm.plan_switch(a, b).estimated_seconds
            hidden = b == base or self.prefetch
            return self.cm.plan_switch(a, b, with_grads=True, weights=not hidden).estimated_seconds

        return plan_order(names, price, base=base)

    def _choose(self, demands: list[BucketDemand], fixed: list[str] | None = None) -> list[str]:
        """The config of each bucket (`fixed`: given), and on the first step the base: the
        optimizer moves to the config (and ZeRO-1 setting) whose step costs least within the budget,
        the current base first on ties (see `CostModel.choose`). Later steps keep their base."""
        names = [c.name for c in self.configs]
        current = Base(self.base, self.zero1)
        if self._base_fixed:
            bases = [current]
        else:
            bases = [current] + [Base(n, z) for n in names for z in self._zero1_options(n) if Base(n, z) != current]
        chosen, base = self.cost.choose(demands, names, bases, self._cycle_seconds, self.state_bytes, fixed=fixed)
        if not self._base_fixed:
            self._base_fixed = True
            if base != current:
                self._report(f"base: {base.config}{' with ZeRO-1' if base.zero1 else ''} holds the optimizer "
                             f"(the step's cheapest cycle within the budget; was {self.base})")
                self._rebase(base)
        return chosen

    def _zero1_options(self, name: str) -> tuple[bool, ...]:
        if self.config(name).fsdp:
            return (False,)  # its optimizer state is fsdp's shards already: nothing for ZeRO-1 to split
        if self._zero1_given or self.config(name).dp == 1:
            return (self.zero1 and self.config(name).dp > 1,)
        return (False, True)  # ZeRO-1 only where the whole optimizer state would not fit: False first

    def _rebase(self, base: Base) -> None:
        """Move the fp32 masters and AdamW to `base`. Before the first optimizer step (or into or out of
        ZeRO-1 chunks, only then) the full masters are gathered and sharded anew; otherwise (no rank
        ever holds the whole model) the masters where they are not the weights, and once trained (an
        elastic job's new Trainer, loaded with a trained job state) the moments, ride along with the
        switch's planned move as attached states."""
        if not self.optimizer.state and (self._dp_group is not None or base.zero1):
            full = self.cm.full_state_dict(canonical=True, params=self._master_shards())
            self.base, self.zero1 = base.config, base.zero1
            self.cm.switch(self.base)
            self._init_optimizer(self.cm.shard_like_params(full))
            return
        if not self.optimizer.state:
            masters = None if self._masters_are_weights else self._masters
            if masters is not None:
                self.cm.attach_state("master", masters)
            try:
                self.cm.switch(base.config)
            finally:
                moved = self.cm.detach_state("master") if masters is not None else self.cm.local_params
            self.base = base.config
            self._init_optimizer(moved)
            return
        if self._dp_group is not None or base.zero1:
            raise RuntimeError("a trained optimizer's base moves without ZeRO-1 only (its chunks are not switched)")
        state = self.job_state()
        riding = [k for k in JOB_STATE if not (k == StateKind.PARAM and self._masters_are_weights)]
        for kind in riding:
            self.cm.attach_state(kind.value, {n: state[state_key(kind, n)] for n in self._names})
        try:
            self.cm.switch(base.config)
        finally:
            moved = {kind: self.cm.detach_state(kind.value) for kind in riding}
        self.base = base.config
        self._init_optimizer(moved.get(StateKind.PARAM, self.cm.local_params))
        self.load_job_state({state_key(kind, n): (moved[kind] if kind in moved else self._masters)[n]
                             for kind in JOB_STATE for n in self._names}, self.step_count)

    def choose_buckets(self, lengths: Sequence[int]) -> tuple[int, ...]:
        """Fix the bucket bounds from a sample of sequence lengths (e.g. the whole dataset's) instead
        of the first batch's: later batches then reuse the same compiled shapes."""
        if self.bucket_configs is not None:
            raise ValueError("bucket_configs fixes one config per given bucket; do not re-choose the buckets")
        self._boundaries = D.choose_boundaries(list(lengths), self._num_buckets, self.length_multiple)
        self._report(f"length buckets: {self._boundaries}")
        return self._boundaries

    def bucket_bounds(self, lengths: list[int]) -> tuple[int, ...]:
        """The bucket bounds for a batch of these lengths: fixed on first use (from the lengths unless
        given), extended by one bound when a longer sequence arrives."""
        if self._boundaries is None:
            self._boundaries = D.choose_boundaries(lengths, self._num_buckets, self.length_multiple)
            self._report(f"length buckets: {self._boundaries}")
        elif max(lengths) > self._boundaries[-1]:
            if self.bucket_configs is not None:
                raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the last bucket bound "
                                 f"{self._boundaries[-1]} and bucket_configs fixes one config per bucket; "
                                 "give a larger last bound")
            self._boundaries = self._boundaries + (D.round_up(max(lengths), self.length_multiple),)
            self._report(f"length buckets extended: {self._boundaries}")
        return self._boundaries

    def _inputs(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(ids, positions, labels), and the document ids when cp configs move tokens."""
        return (*inputs, document_ids_of(inputs[1])) if self.documents else tuple(inputs)

    def _unpacked(self, lengths: list[int]) -> list[D.Bucket]:
        """Models without position_ids/attention_mask: one sequence per row, padded to the bound."""
        buckets = D.make_buckets(lengths, self.bucket_bounds(lengths))
        return [D.Bucket(b.index, b.low, b.high, tuple((i,) for i in b.sequences)) for b in buckets]

    # ------------------------------------------------------------------------------------ optimizer
    @property
    def _masters_are_weights(self) -> bool:
        return self._dp_group is None and self.compute_dtype == torch.float32

    def _init_optimizer(self, masters: dict[str, torch.Tensor]) -> None:
        """fp32 masters (`masters`: this rank's shards in the base layout) and AdamW; ZeRO-1 keeps only
        this dp rank's flat chunk; with fp32 compute and no ZeRO-1 the base's weights are the masters."""
        names = self.cm.logic.param_names
        local = self.cm.local_params
        self._names = list(names)
        self._shapes = {n: local[n].shape for n in names}
        base = self.config(self.base)
        self._dp_group = self.cm.process_group(self.base, "dp") if self.zero1 and base.dp > 1 else None
        if self._dp_group is not None:
            flat = torch.cat([masters[n].reshape(-1) for n in names])
            dp, index = base.dp, dist.get_rank(self._dp_group)
            self._chunk = math.ceil(flat.numel() / dp)
            self._flat_numel = flat.numel()
            flat = torch.nn.functional.pad(flat, (0, self._chunk * dp - flat.numel()))
            self._masters = {"flat": flat[index * self._chunk: (index + 1) * self._chunk].clone()}
            self._dp_index = index
        elif self._masters_are_weights:
            self._masters = local
        else:
            self._masters = {n: masters[n].clone() for n in names}
        self.optimizer = torch.optim.AdamW(list(self._masters.values()), lr=self.adamw.lr, betas=self.adamw.betas,
                                           eps=self.adamw.eps, weight_decay=self.adamw.weight_decay)

    def _optimizer_step(self) -> None:
        grads = self.cm.local_grads
        if grads is None:
            raise RuntimeError("no gradients to apply: the step ran no micro-batch")
        if self._dp_group is not None:
            flat = torch.cat([grads[n].reshape(-1) for n in self._names])
            flat = torch.nn.functional.pad(flat, (0, self._chunk * dist.get_world_size(self._dp_group) - flat.numel()))
            self._masters["flat"].grad = flat[self._dp_index * self._chunk: (self._dp_index + 1) * self._chunk].float()
        else:
            for n, p in self._masters.items():
                p.grad = grads[n].float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.cm.zero_grad()
        self.cm.set_local_params(self._compute_weights(self._master_shards()))

    def _compute_weights(self, masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The compute weights from the fp32 masters: one fused cast (`kernels.cast`) where dtypes differ."""
        if all(t.dtype == self.compute_dtype for t in masters.values()):
            return dict(masters)
        return cast(masters, self.compute_dtype)

    def _master_shards(self) -> dict[str, torch.Tensor]:
        """fp32 masters as this rank's shards in the base layout (ZeRO-1: all-gathered over dp)."""
        if self._dp_group is None:
            return dict(self._masters)
        chunk = self._masters["flat"]
        flat = torch.empty(chunk.numel() * dist.get_world_size(self._dp_group), dtype=chunk.dtype, device=chunk.device)
        dist.all_gather_into_tensor(flat, chunk, group=self._dp_group)
        out, offset = {}, 0
        for n in self._names:
            size = math.prod(self._shapes[n])
            out[n] = flat[offset: offset + size].view(self._shapes[n])
            offset += size
        return out


def _vocab_size(model: nn.Module) -> int | None:
    getter = getattr(model, "get_input_embeddings", None)
    embedding = (
        getter() if callable(getter) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    )
    return getattr(embedding, "num_embeddings", None)
