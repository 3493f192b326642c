"""`scaletrain train`: the config shown, or the job settled and trained here, on --nproc ranks or under torchrun."""

from __future__ import annotations

import argparse

from scaletrain.cli.common import note
from scaletrain.errors import config_paths, os_errors_named


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (options: --section.key=value)",
                       description="Train. Any config option can be given as --section.key=value; "
                                   "see --help-config for the list.")
    p.add_argument("--config", help="TOML config file, or a run's config.json (default: the demo run, "
                                    "configs/tiny.toml; resuming a run folder: that run's own config)")
    p.add_argument("--print-config", nargs="?", const="json", choices=("json", "toml"),
                   help="print the resolved config and exit: JSON (the default), or --print-config=toml, a TOML "
                        "file for --config")
    p.add_argument("--help-config", action="store_true", help="list every config option and exit")
    g = p.add_argument_group("launch (several processes through PyTorch's elastic launcher)")
    g.add_argument("--nproc", type=int, help="processes (ranks) on this node; one per GPU")
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    g.add_argument("--node-rank", type=int, help="this node's rank, for a fixed rendezvous at --rdzv-endpoint")
    g.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, reachable from every node")
    g.add_argument("--rdzv-id", default="scaletrain",
                   help="job name shared by the nodes of one job (default scaletrain); each job needs its own "
                        "--rdzv-endpoint port")
    g.add_argument("--max-restarts", type=int, default=0, help="restart the group this often after a failure")
    p.add_argument("--rank-hook", help=argparse.SUPPRESS)  # hidden, tests only: scaletrain.launch.job.call_rank_hook
    p.set_defaults(func=run, takes_overrides=True, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The config chosen and shown, or the job settled (scaletrain.launch.job) and run: here, on
    --nproc ranks, or as this rank of torchrun's."""
    from scaletrain.config import describe_options
    from scaletrain.launch import job, worker

    if args.help_config:
        print(describe_options())
        return 0
    cfg, notes = job.train_config(args.config, extra)
    if args.print_config:
        for line in notes:  # on stderr: where the config came from, the old option names it used
            note(line)
        print(cfg.to_toml() if args.print_config == "toml" else cfg.to_json())
        return 0
    from scaletrain.runtime import is_worker, pick_device

    if is_worker():  # started by torchrun (our launcher starts scaletrain.launch.worker itself)
        worker.run(job.train, cfg, None, note, args.rank_hook)  # rank 0 settles the job for all; does not return
    with os_errors_named(config_paths(cfg)):
        if args.nproc is None:  # this process is the whole job
            from scaletrain import measure  # parallel.auto_measure_s times layouts in groups of processes
            from scaletrain.train.trainer import Trainer

            cfg, rt = job.start(cfg, note=note, measure=measure)
            trainer = job.call_rank_hook(args.rank_hook, Trainer(cfg, rt))  # checked: the resume included
            for line in notes:
                note(line)
            return job.exit_code(trainer.fit())
        from scaletrain.launch.launcher import check_launch

        check_launch(args.nproc, args.nnodes, args.rdzv_endpoint or "")  # before any arithmetic on the world size
        from scaletrain import measure

        cfg, layout = job.settle(cfg, args.nproc * args.nnodes, pick_device(cfg.train.device, 0, args.nproc),
                                 per_node=args.nproc, note=note, measure=measure if args.nnodes == 1 else None)
        for line in notes:
            note(line)
        return job.launch(cfg, layout, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                          rdzv_endpoint=args.rdzv_endpoint or "", rdzv_id=args.rdzv_id,
                          max_restarts=args.max_restarts, rank_hook=args.rank_hook)
