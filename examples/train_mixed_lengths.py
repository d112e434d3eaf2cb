"""Mixed-length training with hot switching: short sequences under data parallelism, long ones
under tensor + sequence parallelism, one optimizer step per global batch (hs.Trainer).

    torchrun --nproc-per-node 4 examples/train_mixed_lengths.py                  # dp4 and tp4sp
    torchrun --nproc-per-node 2 examples/train_mixed_lengths.py --steps 3        # dp2 and tp2sp
    python examples/train_mixed_lengths.py --data my_tokens.jsonl --nproc 4      # processes spawned by hs.launch

The data is a JSONL file of token ids, one sequence per line: [1, 2, 3] or {"input_ids": [1, 2, 3]}
(examples/data/mixed_lengths.jsonl: 64 sequences of 8 to 113 tokens, long-tailed, as chat and code
corpora are). Each step the Trainer groups the batch's sequences into length buckets, packs each
bucket into rows without mixing sequences in attention, runs every bucket under the config that is
fastest for it within the memory budget (measured the first time a bucket length is seen), switches
weights, gradients and AdamW states between configs, and steps AdamW once: the result equals one
device's AdamW step.
"""
import argparse
import os

import torch
import torch.distributed as dist
import transformers

import hotswitch as hs
from hotswitch.train.data import SampleOrder, load_jsonl

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mixed_lengths.jsonl")


def main(rank: int, args) -> None:
    world = dist.get_world_size()
    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config)
    dataset = load_jsonl(args.data, vocab_size=config.vocab_size)  # a list of 1-D token-id tensors
    order = SampleOrder(len(dataset), args.batch_size, seed=0)  # a seeded order, the same on every rank

    trainer = hs.Trainer(model, [f"dp{world}", f"tp{world}sp"], optimizer=dict(name="adamw", lr=1e-3),
                         memory_budget_bytes=args.memory_budget_mib * 2**20, micro_batch_tokens=args.micro_batch_tokens)
    for step in range(args.steps):
        report = trainer.step([dataset[i] for i in order.batch(step)])  # the same global batch on every rank
        if rank == 0:
            print(report.line(), flush=True)  # loss, tokens/s, switching, the config of each length bucket
    state = trainer.full_state_dict()  # full fp32 weights (a collective: every rank calls it)
    if rank == 0:
        print(f"trained {args.steps} steps under {', '.join(c.name for c in trainer.configs)}; "
              f"{sum(t.numel() for t in state.values()):,} parameters")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=DATA, help="JSONL file of token ids (default: the shipped example)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default: 4)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per global batch (default: 16)")
    parser.add_argument("--memory-budget-mib", type=float, default=4.0,
                        help="per-rank memory budget; at 4 MiB this model's longest bucket does not fit pure data "
                        "parallelism (one row of 128 tokens is more than a replica's 64), so long sequences run "
                        "under tp+sp (default: 4)")
    parser.add_argument("--micro-batch-tokens", type=int, default=64,
                        help="tokens per data-parallel replica per micro-batch (default: 64)")
    parser.add_argument("--nproc", type=int, default=4, help="processes to spawn without torchrun (default: 4)")
    args = parser.parse_args()
    hs.launch(main, int(os.environ.get("WORLD_SIZE", args.nproc)), args)
