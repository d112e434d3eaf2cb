"""`hotswitch rendezvous`: serve the store that elastic agents on several hosts meet in.

    hotswitch rendezvous --port 29400
    hotswitch train --elastic 2:6 --world-size 4 --nproc-per-node 2 --rdzv-endpoint HOST:29400 \\
        --checkpoint-dir /shared/ckpt            # the same command on every host

It runs apart from every training host (as torchft's Lighthouse does), so no host's loss takes the
job's membership with it: torch's c10d rendezvous (which hosts join through) and hotswitch's
generations, step agreement and heartbeats all live in this one TCPStore. Stop it with Ctrl-C once
the job has finished.
"""
from __future__ import annotations

from hotswitch.cli.common import HelpFormatter, plain

__all__ = ["add_parser"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("rendezvous", help="serve the store elastic agents on several hosts meet in",
                              description=plain(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--port", type=int, default=29400, help="TCP port to serve on (0: any free port, printed)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.set_defaults(run=run_rendezvous)


def run_rendezvous(args) -> int:
    import socket

    from hotswitch.elastic.membership import serve_rendezvous

    def ready(port: int) -> None:
        print(f"hotswitch rendezvous: serving on {socket.gethostname()}:{port}; start each host's agent with "
              f"--rdzv-endpoint {socket.gethostname()}:{port}", flush=True)

    try:
        serve_rendezvous(args.port, args.host, ready)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:  # the port is taken
        raise SystemExit(f"hotswitch rendezvous: cannot serve on port {args.port}: {e}") from None
    return 0
