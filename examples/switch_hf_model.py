"""Compile a Hugging Face model for three parallel layouts, train under each, switch between them
and print what every switch cost.

    torchrun --nproc-per-node 4 examples/switch_hf_model.py     # dp4, dp2tp2, tp4sp
    torchrun --nproc-per-node 2 examples/switch_hf_model.py     # dp2, tp2, tp2sp
    python examples/switch_hf_model.py --nproc 4                # the same, processes spawned by hs.launch

The model is a small Qwen2 built from a config (random weights, nothing downloaded), called as it
comes: keyword inputs, labels shifted inside, an output object with `.loss`. Every rank runs the
same code on CPU processes (gloo); tp needs an even number of processes. A switch from pure dp
moves no bytes: every rank already holds the full weights and keeps its slice.
"""
import argparse
import os

import torch
import torch.distributed as dist
import transformers

import hotswitch as hs

LR = 0.1


def qwen2_and_batch():
    torch.manual_seed(0)  # the same weights and batch on every rank
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    ids = torch.randint(0, config.vocab_size, (8, 32))
    return transformers.Qwen2ForCausalLM(config), dict(input_ids=ids, labels=ids)  # the model shifts the labels


def main(rank: int, steps: int) -> None:
    world = dist.get_world_size()
    model, batch = qwen2_and_batch()  # batch: the global batch, the same on every rank
    cm = hs.compile(model, batch, configs=[f"dp{world}", f"dp{world // 2}tp2", f"tp{world}sp"])
    say = print if rank == 0 else (lambda *args: None)
    names = cm.plan_order([c.name for c in cm.configs]).order  # the cheapest cycle through the configs
    say(f"compiled {', '.join(names)} on {world} processes")

    switches = []
    for name in names + names[:1]:  # back to the first config at the end
        if name != cm.active:
            plan = cm.plan_switch(cm.active, name)  # pure: who sends which slice to whom
            stats = cm.switch(name)  # weights (and gradients, attached states) move by that plan
            switches.append((f"{stats.source} -> {stats.destination}", plan.bytes_moved, stats.seconds))
        for _ in range(steps):
            loss = cm.forward_backward(**cm.shard_inputs(**batch))  # this rank's part in, the global loss out
            with torch.no_grad():  # SGD on this rank's shards of the active config
                for n, p in cm.local_params.items():
                    p -= LR * cm.local_grads[n]
            cm.zero_grad()
            say(f"{name:>8}  loss {loss.item():.4f}")

    for what, moved, seconds in switches:
        say(f"switch {what:<18} {moved / 2**20:7.3f} MiB moved  {seconds * 1e3:7.1f} ms")
    state = cm.full_state_dict()  # full tensors on every rank, e.g. to save
    say(f"final state: {sum(t.numel() for t in state.values()):,} parameters")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="SGD steps under each config (default: 2)")
    parser.add_argument("--nproc", type=int, default=4, help="processes to spawn without torchrun (default: 4)")
    args = parser.parse_args()
    # Under torchrun this process is one of WORLD_SIZE ranks; otherwise hs.launch spawns --nproc of them.
    hs.launch(main, int(os.environ.get("WORLD_SIZE", args.nproc)), args.steps)
