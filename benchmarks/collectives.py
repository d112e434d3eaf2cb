"""What each config's ExecGraph communicates, against what Megatron's rules assume.

    python benchmarks/collectives.py [--model gpt-small] [--world-size 4] [--length 256]
                                     [--micro-batch-tokens 1024] [--json PATH]

On `--world-size` gloo processes a Trainer lowers every config of the search space for one
micro-batch (rows of `--length` tokens, `--micro-batch-tokens` per replica) and reads the
collectives of its ExecGraph (`search.comm.CommProfile`): per kind and phase (forward, backward,
the gradient reduction) the calls and the bytes one rank sends in a ring. Beside them, the cost
model's rules (`search.cost.micro_batch_work` without a profile: Megatron's 4 all-reduces per layer
under TP, reduce-scatters and all-gathers under SP, the gradient all-reduce over dp). Where the two
differ, the search prices the ExecGraph (`Trainer(configs="auto")` reads it); the difference is also
a list of what the compiler issues beyond Megatron's plan.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter


def _worker(rank: int, model_name: str, length: int, micro_batch_tokens: int) -> dict:
    import torch

    from hotswitch.distconfig import Topology
    from hotswitch.models import build_model
    from hotswitch.search import describe_workload, enumerate_configs
    from hotswitch.train.trainer import Trainer

    torch.manual_seed(0)
    model = build_model(model_name)
    world = torch.distributed.get_world_size()
    space = enumerate_configs(describe_workload(model), Topology.from_env(world))
    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    trainer = Trainer(model, list(space.configs), micro_batch_tokens=micro_batch_tokens, progress=say)
    return dict(profiles=trainer.comm_profiles(length), configs=[c.spec() for c in space.configs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--json", default="collectives.json")
    args = p.parse_args(argv)

    import torch

    from hotswitch.distconfig import DistConfig, Topology
    from hotswitch.distributed.launch import launch
    from hotswitch.models import build_model
    from hotswitch.search import describe_workload
    from hotswitch.search.comm import ring_bytes
    from hotswitch.search.cost import micro_batch_work, rows_per_replica

    out = launch(_worker, args.world_size, args.model, args.length, args.micro_batch_tokens)
    with torch.device("meta"):
        workload = describe_workload(build_model(args.model))
    topology = Topology(args.world_size, args.world_size)
    rows = rows_per_replica(args.length, args.micro_batch_tokens)
    report = {}
    print(f"\n{args.model} on {args.world_size} gloo processes, rows of {args.length} tokens, {rows * args.length} "
          "tokens per replica per micro-batch; bytes one rank sends (ring)")
    print(f"{'config':>10} {'ExecGraph calls':>16} {'MiB':>8} {'rules calls':>12} {'MiB':>8}   ExecGraph by kind/phase")
    for spec in out["configs"]:
        config = DistConfig.parse(spec)
        profile = out["profiles"][config.name]
        calls, sent = Counter(), Counter()
        for c in profile.collectives:
            key = f"{c.kind}/{'activation' if c.per_token else 'gradient'}"
            calls[key] += 1
            sent[key] += ring_bytes(c.kind, c.nbytes, c.group_size)
        rules = micro_batch_work(workload, config, args.length, rows, topology)
        rules_bytes = rules.comm_seconds * topology.intra_node_bandwidth  # one node: every group on its link
        graph_bytes = sum(sent.values())
        detail = ", ".join(f"{k} {calls[k]} ({sent[k] / 2**20:.1f})" for k in sorted(calls))
        print(f"{config.name:>10} {len(profile.collectives):>16} {graph_bytes / 2**20:>8.1f} {rules.collectives:>12} "
              f"{rules_bytes / 2**20:>8.1f}   {detail}")
        report[config.name] = dict(exec_graph_calls=len(profile.collectives), exec_graph_bytes=graph_bytes,
                                   rules_calls=rules.collectives, rules_bytes=rules_bytes,
                                   by_kind={k: [calls[k], sent[k]] for k in calls})
    with open(args.json, "w") as f:
        json.dump(dict(args=vars(args), configs=report), f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
