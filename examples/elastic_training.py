"""Elastic training: the workers change while the job trains, and the job state (fp32 weights,
AdamW moments, data position) moves by the switch planner instead of a checkpoint + restart.

    python examples/elastic_training.py                       # 2 workers, 4 after step 2, one dies after step 4
    python examples/elastic_training.py --workers 4 --configs dp4 --scale none --kill 1 --steps 2

The launching process is the agent (hotswitch.elastic.run_elastic): it spawns the workers, sees one
die at once (SIGKILL here, from the worker itself) and publishes who trains next; survivors keep
their shards and their traced model, and only what a worker lacks is sent. The candidate configs
are re-instantiated for each worker count (tp and sp kept, dp scaled: on 3 workers "dp2" becomes
"dp3" and "tp2sp", which 3 does not fit, drops out). Not for torchrun: torchrun restarts every worker
on a change of membership.
"""
import argparse
import os
import signal
import tempfile

import torch
import transformers

from hotswitch.elastic import ElasticJob, Event, run_elastic
from hotswitch.train.data import SampleOrder, load_jsonl

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mixed_lengths.jsonl")


def build_model():
    torch.manual_seed(0)  # the same weights on every worker, joiners included
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config)


def worker(membership, args):
    """Runs in every worker, also in those spawned later; returns the result on the job's rank 0."""
    dataset = load_jsonl(args.data, vocab_size=512)
    order = SampleOrder(len(dataset), args.batch_size, seed=0)  # global batch k is the same for any dp degree
    planned = [Event(step, "scale", n) for step, n in args.scale]  # applied after `step` optimizer steps
    kill_generation = len(planned)  # after the planned changes: die once, not again when the step is re-run

    def batch(step):
        # `step` counts the optimizer steps done: global batch `step` makes step `step + 1`
        if step == args.kill and membership.generation == kill_generation \
                and membership.wid == membership.job_members[-1]:
            print(f"[{membership.wid}] SIGKILL to myself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        ids = order.batch(step)
        return ids, [dataset[i] for i in ids]

    def on_step(report, replayed):  # on the job's rank 0
        print(report.line() + (" (replayed)" if replayed else ""), flush=True)

    job = ElasticJob(membership, build_model, args.configs, batch,
                     trainer_options=dict(optimizer=dict(name="adamw", lr=1e-3), buckets=(32, 64, 128)),
                     checkpoint_dir=args.checkpoint_dir, checkpoint_every=2, on_step=on_step)
    return job.run(args.steps, planned)


def _scale(text: str) -> tuple[int, int] | None:
    return None if text == "none" else tuple(int(x) for x in text.split(":"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers at the start (default: 2)")
    parser.add_argument("--configs", default="dp2,tp2sp", help="candidate configs for the starting workers, "
                        "re-instantiated for every later count (default: dp2,tp2sp)")
    parser.add_argument("--scale", type=_scale, action="append", metavar="STEP:N",
                        help="planned change to N workers after STEP steps, repeatable; 'none': no planned "
                        "change (default: 2:4)")
    parser.add_argument("--kill", type=int, default=4, metavar="STEP", help="a worker SIGKILLs itself after "
                        "STEP steps, once; -1: none (default: 4)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (default: 6)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per global batch (default: 16)")
    parser.add_argument("--data", default=DATA, help="JSONL file of token ids (default: the shipped example)")
    args = parser.parse_args()
    args.scale = [s for s in args.scale or [(2, 4)] if s is not None]
    most = max([args.workers] + [n for _, n in args.scale])
    with tempfile.TemporaryDirectory() as args.checkpoint_dir:  # asynchronous DCP checkpoints, for lost slices
        result = run_elastic(worker, args.workers, args, min_size=2, max_size=most)
    for r in result["reconfigurations"]:
        print(f"change {r['generation']} ({r['reason']}): {r['source']} -> {r['destination']} workers after step "
              f"{r['step']}, state from {r['restored_from']}, {r['bytes_moved'] / 2**20:.2f} MiB moved in "
              f"{r['move_seconds']:.2f} s, training again after {r['seconds']:.1f} s")
    print(f"{result['steps']} steps on workers {', '.join(result['workers'])} under {', '.join(result['configs'])}; "
          f"final loss {result['loss']:.4f}")


if __name__ == "__main__":
    main()
