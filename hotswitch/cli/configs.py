"""`hotswitch configs`: the Pareto set of DistConfigs per sequence length, and the set to hot-switch
between (pure planning: no processes, nothing runs)."""
from __future__ import annotations

import argparse
import time

from hotswitch.cli.common import HelpFormatter, add_json_argument

__all__ = ["add_parser"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "configs", formatter_class=HelpFormatter,
        help="the Pareto front of DistConfigs (time vs memory) per sequence length, and the set "
        "to hot-switch between (no GPU needed)",
        description="Price every DistConfig (dp x tp x pp, sp) of --world-size / --devices devices at each "
        "length with the analytical cost model (FLOPs, memory traffic, collectives over the topology's links, "
        "memory per rank), print the configs on the Pareto front per length and the candidate set that "
        "minimises the expected step time including switching, and draw time vs memory to a PNG. Built-in "
        "models (hotswitch.models) are priced as the Trainer runs them (their dtype, pp = 1, CPU rates unless "
        "--gpu); cluster models (gpt3-175b, llama2-70b, ...) as Megatron runs them on H100 nodes.")
    p.add_argument("--model", default="gpt-small", help="a built-in model (gpt-tiny, gpt-small, ...) or a cluster "
                   "model (gpt3-175b, llama2-70b, ...)")
    p.add_argument("--world-size", "--devices", dest="devices", type=int, default=4,
                   help="devices in the job")
    p.add_argument("--devices-per-node", type=int, default=None,
                   help="devices per node (default: all on one node for built-in models, 8 for cluster models)")
    p.add_argument("--lengths", default="64,256,1024", help="comma-separated sequence lengths")
    p.add_argument("--tokens-per-length", type=int, default=None,
                   help="tokens of each length per step (default micro-batch tokens x devices)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="tokens per data-parallel replica per micro-batch (default 1024; 2048 for cluster models)")
    p.add_argument("--memory-budget-mib", type=float, default=None, help="per-rank memory budget in MiB")
    p.add_argument("--zero1", action=argparse.BooleanOptionalAction, default=None,
                   help="the base config shards Adam states over its dp ranks (--no-zero1: never; default: "
                        "whichever is cheaper within the budget)")
    p.add_argument("--all", action="store_true", help="list every config, not only the Pareto front")
    p.add_argument("--gpu", action="store_true", help="price a built-in model with H100 rates instead of CPU ones")
    p.add_argument("--profile", action="store_true",
                   help="time every config's rank 0 on this machine in a fake process group (compute and the "
                        "compiler's peak memory measured, collectives read off its ExecGraph) and fit the rates "
                        "to that; built-in models only")
    p.add_argument("--plot", default="configs.png", metavar="PATH", help="where to draw time vs memory ('' for "
                   "none)")
    add_json_argument(p, None, "every estimate")
    p.set_defaults(run=run_configs)


def run_configs(args) -> int:
    t0 = time.perf_counter()
    from hotswitch.switch.cluster import MODELS

    cluster = args.model in MODELS
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"hotswitch configs: --lengths {args.lengths!r} must be comma-separated integers")
    from hotswitch.distconfig import Topology
    from hotswitch.search import Hardware, search_configs
    from hotswitch.switch.simulate import gpu_cluster
    from hotswitch.train.cost_model import NoConfigFits

    per_node = args.devices_per_node or (min(8, args.devices) if cluster else args.devices)
    try:
        if cluster:
            model, hardware = args.model, Hardware()
            topology = gpu_cluster(args.devices, per_node)
        else:
            import torch

            from hotswitch.models import build_model

            with torch.device("meta"):  # the shape is all the search reads: no weights are made
                model = build_model(args.model)
            hardware = Hardware() if args.gpu else Hardware.cpu()
            topology = Topology(args.devices, per_node)
        budget = None if args.memory_budget_mib is None else int(args.memory_budget_mib * 2**20)
        micro_batch_tokens = args.micro_batch_tokens or (2048 if cluster else 1024)
        probes, comm = (), None
        if args.profile:
            if cluster:
                raise ValueError(f"--profile runs every config's rank on this machine; {args.model} is a cluster "
                                 "model: use a built-in one (gpt-tiny, gpt-small, ...) or leave --profile out")
            import functools
            import sys

            from hotswitch.search import describe_workload
            from hotswitch.train.profiled import profile_space

            probes, comm = profile_space(functools.partial(build_model, args.model), describe_workload(model),
                                         topology, lengths, micro_batch_tokens,
                                         progress=lambda m: print(m, file=sys.stderr, flush=True))
        result = search_configs(model, lengths=lengths, topology=topology, memory_budget_bytes=budget,
                                micro_batch_tokens=micro_batch_tokens, tokens_per_length=args.tokens_per_length,
                                hardware=hardware, zero1=args.zero1, probes=probes, comm_profiles=comm)
    except (ValueError, NoConfigFits) as e:
        raise SystemExit(f"hotswitch configs: {e}")
    print(result.table(frontier_only=not args.all))
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        from hotswitch.progress import write_json

        write_json(args.json, dict(model=args.model, devices=args.devices, devices_per_node=per_node,
                                   chosen=[c.spec() for c in result.chosen], base=result.base,
                                   assignment={str(k): v for k, v in result.assignment.items()},
                                   expected_seconds=result.expected_seconds,
                                   estimates=result.rows(frontier_only=False)))
        if args.json != "-":
            print(f"wrote {args.json}")
    print(f"searched {sum(len(e) for e in result.estimates.values())} (config, length) pairs and "
          f"{result.switch_plans} switch plans in {result.search_seconds:.2f} s; "
          f"{time.perf_counter() - t0:.2f} s in all")
    return 0
