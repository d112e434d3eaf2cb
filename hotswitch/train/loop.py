"""One Trainer over a dataset's seeded global batches, as `hotswitch train` and `hotswitch bench
train` run it on every rank: the options, the model and dataset they name, and the run itself."""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

from hotswitch.progress import Progress

__all__ = ["HF_MODELS", "TrainOptions", "TrainingRun", "build_model", "load_dataset", "run_side_by_side",
           "summary_line"]

HF_MODELS = {"llama-tiny": "llama"}  # Hugging Face models built from a small config, random weights


@dataclass(frozen=True)
class TrainOptions:
    model: str
    world_size: int
    dataset: str
    steps: int
    batch_size: int
    max_length: int
    configs: tuple[str, ...]
    static: str | None
    memory_budget: float | None  # bytes
    micro_batch_tokens: int
    buckets: tuple[int, ...] | None
    lr: float
    seed: int
    zero1: bool
    save_final: str | None
    warmup_steps: int = 0  # steps run first and left out of the summary (compilation, profiling)
    quiet: bool = False
    elastic: tuple[int, int] | None = None  # (MIN, MAX) workers
    events: tuple = ()  # (step, "scale", n) | (step, "redeploy", None)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 2
    step_timeout: float = 30.0
    rendezvous: object | None = None  # several hosts: a hotswitch.elastic.membership.Rendezvous (a higher layer)
    backend: str | None = None  # nccl | gloo; None: nccl when every process gets a GPU
    prefetch: bool = True  # the next config's weights move while the current one computes
    cp_layout: str = "contiguous"  # how cp configs lay out the sequence (CompiledModel.cp_layout)
    compile_backend: str = "eager"  # how ExecGraphs run: op by op, or compiled by Inductor (runtime.backend)
    grad_bucket_bytes: int | None = None  # data-parallel gradient buckets (hs.compile's); None: 25 MiB


def trainer_options(opts: TrainOptions, memory_budget_bytes: int | None, buckets) -> dict:
    """The Trainer's keyword arguments that `hotswitch train`'s options set, one copy for the plain
    run and the elastic job (which left --no-prefetch and --cp-layout out when it had its own)."""
    return dict(optimizer=dict(name="adamw", lr=opts.lr), memory_budget_bytes=memory_budget_bytes, buckets=buckets,
                micro_batch_tokens=opts.micro_batch_tokens, prefetch=opts.prefetch, cp_layout=opts.cp_layout,
                backend=opts.compile_backend, grad_bucket_bytes=opts.grad_bucket_bytes)


def build_model(opts: TrainOptions):
    import torch

    from hotswitch.models import build_hf_model, build_model

    torch.manual_seed(opts.seed)  # identical weights on every rank
    if opts.model in HF_MODELS:
        return build_hf_model(HF_MODELS[opts.model]).model
    return build_model(opts.model)



def load_dataset(opts: TrainOptions, vocab_size: int):
    from hotswitch.train import data as D

    if opts.dataset == "synthetic-skewed":
        return D.synthetic_skewed(max(opts.batch_size * opts.steps, 4 * opts.batch_size), vocab_size, opts.max_length,
                                  seed=opts.seed)
    return D.load_jsonl(opts.dataset, vocab_size)



def summary_line(result: dict) -> str:
    s = result["summary"]
    return (f"{s['steps']} steps: {s['tokens_per_second']:,.0f} tokens/s, exposed switching "
            f"{s['switch_seconds']:.2f} s = {100 * s['switch_share']:.1f}% of step time "
            f"({s['overlapped_switch_seconds']:.2f} s overlapped), "
            f"final loss {s['final_loss']:.4f}")



class TrainingRun:
    """One Trainer on this rank over the dataset's seeded global batches."""

    def __init__(self, opts: TrainOptions, configs: list, rank: int, budget: float | None = None,
                 bounds: tuple[int, ...] | None = None):
        import warnings

        from hotswitch.train import data as D
        from hotswitch.train.trainer import Trainer

        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"hotswitch: .* could not be sharded")  # replicated fallback, exact
        self.opts, self.show = opts, rank == 0 and not opts.quiet
        model = build_model(opts)
        self.dataset = load_dataset(opts, model.get_input_embeddings().num_embeddings)
        self.order = D.SampleOrder(len(self.dataset), opts.batch_size, seed=opts.seed)
        # a static run keeps the hot run's buckets: short rows are cheaper under any config
        options = trainer_options(opts, budget or opts.memory_budget, bounds or opts.buckets)
        self.trainer = Trainer(model, configs, **options, zero1=opts.zero1, progress=Progress() if self.show else None)
        if bounds is None and opts.buckets is None:
            self.trainer.choose_buckets([len(s) for s in self.dataset])  # from the dataset's length distribution
        self.bounds = self.trainer.bucket_bounds([len(s) for s in self.dataset])
        self.reports = []

    def train(self) -> dict:
        """Warm-up steps, then the measured ones, with a progress bar; returns `result()`."""
        from tqdm import tqdm

        total = self.opts.warmup_steps + self.opts.steps
        bar = tqdm(
            total=total, desc="training", unit="step", disable=not self.show or None, leave=False, file=sys.stderr
        )
        for step in range(total):
            self.step(step, write=tqdm.write)
            bar.update()
        bar.close()
        return self.result()

    def step(self, step: int, write=None) -> None:
        report = self.trainer.step([self.dataset[i] for i in self.order.batch(step)])
        warm = step < self.opts.warmup_steps
        if not warm:
            self.reports.append(report)
        if self.show:
            extra = f" (profile {report.profile_seconds:.1f}s, compile {report.compile_seconds:.1f}s)" \
                if report.profile_seconds + report.compile_seconds > 0.05 else ""
            (write or print)(report.line() + extra + (" [warm-up, not counted]" if warm else ""), file=sys.stdout)

    def result(self) -> dict:
        reports = self.reports
        seconds = sum(r.seconds for r in reports)
        switch = sum(r.switch_seconds for r in reports)
        overlapped = sum(r.overlapped_switch_seconds for r in reports)
        summary = dict(
            steps=len(reports),
            tokens=sum(r.tokens for r in reports),
            seconds=seconds,
            switch_seconds=switch,
            tokens_per_second=sum(r.tokens for r in reports) / seconds,
            switch_share=switch / seconds,  # exposed: what the steps waited for
            overlapped_switch_seconds=overlapped,  # weights prefetched while another config computed
            handed_off_bytes=sum(r.handed_off_bytes for r in reports),  # gradients sent during a backward
            final_loss=reports[-1].loss,
            losses=[r.loss for r in reports],
        )
        return dict(summary=summary, reports=[_report_dict(r) for r in reports], profile=self.trainer.cost.table(),
                    base=self.trainer.base, budget=self.trainer.memory_budget_bytes)



def _report_dict(report) -> dict:
    d = asdict(report)
    d.update(switch_seconds=report.switch_seconds, tokens_per_second=report.tokens_per_second)
    return d




def run_side_by_side(runs: dict[str, TrainingRun], steps: int) -> None:
    """Step every run through global batches 0..steps-1, all runs taking batch k before any takes
    k + 1, so that benchmarks compare them on the same machine state."""
    import torch.distributed as dist

    for step in range(steps):
        for label, run in runs.items():
            if run.show:
                print(f"{label}: ", end="", flush=True)
            run.step(step)
            dist.barrier()
