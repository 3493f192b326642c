"""`scaletrain VERB ...`: the front door, one module per verb, each a thin call into the library.

Each verb's module holds its parser (`add_parser`) beside its handler; VERBS below lists them in the
order --help shows. What the verbs share (the one-line errors, --version, the config options left
over) is in scaletrain.cli.common. A user error (bad config, data, checkpoint or launch request)
prints one line per problem and exits with code 2; there is no traceback for those.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence

from scaletrain import console, threads
from scaletrain.cli import (
    bench,
    eval,
    export,
    ft_local,
    generate,
    lighthouse,
    plan,
    plot,
    prepare,
    quantize,
    schedule,
    train,
    verify,
)
from scaletrain.cli.common import PROG, Done, Parser, Version, leftovers, refuse
from scaletrain.errors import UserError, user_error_from_os
from scaletrain.interrupt import STOP_SIGNALS, EarlySignals, Terminated

VERBS = {  # verb: its module, whose add_parser(sub) declares the verb's options and the handler they reach
    "train": train,
    "prepare": prepare,
    "eval": eval,
    "plot": plot,
    "generate": generate,
    "plan": plan,
    "schedule": schedule,
    "export": export,
    "quantize": quantize,
    "verify": verify,
    "bench": bench,
    "lighthouse": lighthouse,
    "ft-local": ft_local,
}


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="Train models too big or too slow for one GPU.")
    parser.add_argument("--version", action=Version)
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=Parser)
    for module in VERBS.values():
        module.add_parser(sub)
    return parser


def _stopped(signum: int, verb: str | None) -> int:
    """A signal that reached the command line: the trainer was not there to save anything."""
    name = signal.Signals(signum).name
    if verb == "train":
        print(f"scaletrain: error: stopped by {name} before training started: no checkpoint was written",
              file=sys.stderr)
        return 3
    print(f"scaletrain: stopped by {name}", file=sys.stderr)
    return 128 + signum


def main(argv: Sequence[str] | None = None, guard: EarlySignals | None = None) -> int:
    """The exit code of the command `argv` (default: this program's own command line, whose
    result then stands: later signals are absorbed). `guard`: the stop signals' handler the
    program installed first (scaletrain.__main__); without it, main installs one (and, given
    `argv`, restores the caller's after)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if program:  # before torch is imported: OpenMP reads its wait policy once, when it loads
        os.environ.update(threads.wait_env(os.environ))
        console.prefix_lines()  # ft-local's groups: every line names its group
    verb = None
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if guard is None and not program else {}
    try:  # from here on, a Ctrl-C or SIGTERM (even in `import torch`) is one line
        if guard is None:
            guard = EarlySignals.install()
        if guard is not None:
            guard.on_stuck = lambda signum: _stopped(signum, verb)  # the verb once known
            guard.check()  # one that came while the program started
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        args.argv, verb = argv, args.verb
        extra = leftovers(args.parser, extra, args.takes_overrides)
        return args.func(args, extra)
    except Done:
        return 0
    except UserError as e:
        return refuse(e.lines, e.exit_code)
    except OSError as e:  # a read-only, full or missing path the user gave: one line; anything else is ours
        error = user_error_from_os(e)
        if error is None:
            raise
        return refuse(error.lines[:1], error.exit_code)
    except KeyboardInterrupt:  # not inside the trainer's fit, which handles SIGINT itself
        return _stopped(signal.SIGINT, verb)
    except Terminated:
        return _stopped(signal.SIGTERM, verb)
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if program:
                    signal.signal(sig, signal.SIG_IGN)
                elif before.get(sig) is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # a stop absorbs
                    signal.signal(sig, before[sig])
