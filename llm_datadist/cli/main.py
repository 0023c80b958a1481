"""Command line: ``python -m llm_datadist {demo,bench,info}``.

* ``demo``: a prefill and a decode process on this host, a paged KV cache of a 7B-class model,
  a batch of requests moved and verified byte for byte (``demo.py``); with ``--role``, one side on
  each of two hosts (``demo_roles.py``);
* ``bench``: block size x data plane x direction against an in-run memcpy (``bench.py``); with
  ``--role``, the table between two hosts (``bench_roles.py``);
* ``info``: version, build, device runtimes, data planes of this host (``info.py``).

Exit status: 0 success; 1 the demo's verification failed; 2 bad input or the command could not run;
130 interrupted (Ctrl-C), after the command's processes were stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in [0, 3600] seconds, got {value}")
    return value


def _timeout(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {value}")
    return value


def _address(listening: bool):
    """An argparse type: ``HOST:PORT`` (``two_hosts.parse_address``)."""
    def parse(text: str) -> tuple:
        from llm_datadist.cli.two_hosts import parse_address
        try:
            return parse_address(text, listening)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _size(text: str) -> int:
    from llm_datadist.cli.console import parse_size
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0 < value <= 1 << 30:
        raise argparse.ArgumentTypeError(f"must be between 1 byte and 1 GiB, got {text}")
    return value


def _list_of(choices: dict, what: str):
    """An argparse type: a comma-separated list of the keys of ``choices``, each standing for its
    value (a name, or a tuple of names: ``both`` -> ``("push", "pull")``); duplicates dropped."""
    def parse(text: str) -> list:
        items = [item.strip().lower() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if not items or unknown:
            raise argparse.ArgumentTypeError(f"{what}: {', '.join(unknown) or 'none given'}; "
                                             f"choose from {', '.join(sorted(set(choices)))}")
        names = []
        for item in items:
            value = choices[item]
            names += value if isinstance(value, tuple) else [value]
        return list(dict.fromkeys(names))
    return parse


def _sizes(text: str) -> list:
    sizes = [_size(item) for item in text.split(",") if item.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("no block size given")
    return sorted(set(sizes))


# -- commands ---------------------------------------------------------------------------------------

def _demo(args: argparse.Namespace) -> int:
    """0 verified, 1 verification failed, 2 could not run (130 on Ctrl-C: ``__main__`` turns the
    interrupt into it). One host (``demo.run``) or, with ``--role``, one side of two hosts
    (``demo_roles.run``)."""
    from llm_datadist.cli import demo as _demo, demo_roles
    problem = demo_roles.check_args(args)
    if problem is not None:
        print(f"demo: {problem}", file=sys.stderr)
        return 2
    geometry = _demo.Geometry(args.layers, args.block_size, args.kv_heads, args.head_dim)
    out = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    # Lines a user needs even with --json (where the decode side listens): on stderr then.
    note = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else out
    started = time.perf_counter()
    try:
        if args.role is not None:
            report = demo_roles.run(args, out, note)
        else:
            report = _demo.run(geometry, args.requests, args.tokens, args.pull, args.plane, args.device, args.seed,
                               args.corrupt_block, out)
    except _demo.DemoError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    except MemoryError:  # the budget is an estimate; never a traceback and exit 1 ("failed")
        print(f"demo: out of memory; {_demo.SIZE_FLAGS}", file=sys.stderr)
        return 2
    report["wall_seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _demo.print_report(report, out)
    return 0 if report["verified"] else 1


def _bench(args: argparse.Namespace) -> int:
    from llm_datadist import LLMException
    from llm_datadist.cli import bench as _bench, bench_roles
    from llm_datadist.cli.two_hosts import TwoHostError
    from llm_datadist.testing import ChildError
    problem = bench_roles.check_args(args, build_parser().parse_args(["bench"]))
    if problem is not None:
        print(f"bench: {problem}", file=sys.stderr)
        return 2
    out = lambda line: print(line, flush=True)  # noqa: E731
    planes, gpu, client = args.planes, args.gpu, None
    try:
        if args.role == "server":
            return bench_roles.serve(args, out)
        if args.role == "client":
            client = bench_roles.ClientSide(args)
            planes = planes if planes is not None else _bench.cross_host_planes()
            gpu = "off"  # the GPU rows are same-host ones
        if planes is None and gpu == "only":
            planes = ()
        elif planes is None:  # every plane this host has
            planes, note = _bench.available_planes()
            if note:
                print(f"note: {note}", flush=True)
        config = _bench.SweepConfig(sizes=args.sizes, planes=planes, directions=args.directions,
                                    total=args.total, min_time=args.min_time, gpu=gpu,
                                    gpu_sizes=args.gpu_sizes, gpu_total=args.gpu_total)
        json_path = args.json or time.strftime("llm_datadist-bench-%Y%m%d-%H%M%S.json")
        return _bench.run(config, json_path, args.plot, out, client)
    except ChildError as exc:  # a client process of the client role failed (say, to link)
        print(f"bench: {exc.message}", file=sys.stderr)
        return 2
    except (_bench.BenchError, TwoHostError, OSError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    except LLMException as exc:
        print(f"bench: {str(exc).split(' (status_code')[0]}", file=sys.stderr)
        return 2


def _info(args: argparse.Namespace) -> int:
    from llm_datadist.cli.info import all_facts
    facts = all_facts()
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    for key, value in facts.items():
        if isinstance(value, dict):
            print(f"{key}:")
            width = max([8, *map(len, value)])
            for sub, text in value.items():
                print(f"  {sub:{width}s} {text}")
        else:
            print(f"{key}: {value}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a refusal is one line on stderr (the usage is one ``--help`` away), exit 2.
    Subcommand parsers are of the same class (``add_subparsers`` uses the parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _two_host_flags(hosts, listening: str, linking: str, peer_help: str, waits: str) -> None:
    """``--listen``, ``--peer``, ``--secret-file`` and ``--timeout`` of a command's two-host roles
    (``--role`` itself is the command's: its help says what each side does)."""
    from llm_datadist.cli.two_hosts import DEFAULT_TIMEOUT_S
    hosts.add_argument("--listen", type=_address(True), default=None, metavar="HOST:PORT",
                       help=f"{listening}: the address to listen on (port 0: any free port; the port is printed)")
    hosts.add_argument("--peer", type=_address(False), default=None, metavar="HOST:PORT",
                       help=f"{linking}: {peer_help}")
    hosts.add_argument("--secret-file", default=None, metavar="PATH",
                       help="a file holding the link secret both sides share (its text, at least 16 bytes; "
                            "yours, with no permission for group or others: chmod 600)")
    hosts.add_argument("--timeout", type=_timeout, default=None, metavar="SECONDS",
                       help=f"the longest wait for the other side: to link, to answer, {waits} "
                            f"(default {DEFAULT_TIMEOUT_S:g})")


def build_parser() -> argparse.ArgumentParser:
    from llm_datadist.cli.bench import DEFAULT_MIN_TIME, DEFAULT_SIZES, DEFAULT_TOTAL, DIRECTIONS, GPU_MODES, \
        all_planes, plane_aliases
    from llm_datadist.cli.device_workload import DEFAULT_SIZES as GPU_SIZES, DEFAULT_TOTAL as GPU_TOTAL
    from llm_datadist.transport import planes
    from llm_datadist import __version__
    from llm_datadist.cli.console import short_size
    from llm_datadist.cli.demo import MAX_REQUESTS
    from llm_datadist import runtimes
    parser = _Parser(prog="python -m llm_datadist",
                                     description="KV-cache transfer for disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"llm_datadist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,info}")

    demo = sub.add_parser(
        "demo", help="prefill -> decode of a batch of requests on this host, verified and timed",
        description="Start a prefill and a decode process on this host, give both a paged KV cache "
                    "(default: the per-layer geometry of a 7B model, Llama-2-7B: 32 layers, 32 KV heads, "
                    "head dim 128, fp16, 16-token blocks), fill the blocks of a batch of requests with "
                    "known data on the prefill side, move them to the decode side (push, or pull), "
                    "check every byte there and report throughput and per-request latency. The sizes "
                    "are checked against the memory available before anything starts. Exit status 0: "
                    "verified; 1: verification failed; 2: could not run; 130: interrupted.")
    model = demo.add_argument_group("model and batch")
    model.add_argument("--layers", type=_positive, default=32, help="model layers, each a K and a V tensor "
                       "(default 32)")
    model.add_argument("--block-size", type=_positive, default=16, help="tokens per block (default 16)")
    model.add_argument("--kv-heads", type=_positive, default=32, help="KV heads (default 32)")
    model.add_argument("--head-dim", type=_positive, default=128, help="head dimension (default 128)")
    model.add_argument("--requests", type=_positive, default=8,
                       help=f"requests in the batch (default 8, at most {MAX_REQUESTS:,})")
    model.add_argument("--tokens", type=_positive, default=64,
                       help="prompt tokens per request; a request owns ceil(tokens / block size) blocks "
                            "(default 64)")
    model.add_argument("--seed", type=_non_negative, default=0, help="seed of the data and block ids (default 0)")
    transfer = demo.add_argument_group("transfer")
    transfer.add_argument("--pull", action="store_true",
                          help="the decode side pulls (pull_blocks) instead of the prefill side pushing")
    plane_help = "; ".join(f"{name} = {planes.get(name).summary}" for name in planes.names())
    transfer.add_argument("--plane", choices=planes.choices(), default=None,
                          help=f"data plane (llm.DataPlane): {plane_help}; default: LLM_DATADIST_DATA_PLANE "
                               f"or auto")
    transfer.add_argument("--device", choices=runtimes.choices(), default=None,
                          help="device runtime of the DEVICE caches (LLM_DATADIST_DEVICE); default: that "
                               "variable or auto, which uses cpu when the detected runtime's memory cannot "
                               "move between processes yet")
    output = demo.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print the report as JSON")
    output.add_argument("--corrupt-block", type=_non_negative, default=None, metavar="N",
                        help="self-test of the verifier: after the transfer, flip one byte of block N of "
                             "the batch (counted over the requests in order; layer 0, K) on the decode "
                             "side; the demo must report that block and exit with status 1")
    hosts = demo.add_argument_group(
        "two hosts", "run one side here and the other on another host: the prefill side sends its workload "
                     "flags, which must equal the decode side's; the decode side checks every byte and both "
                     "exit with its verdict")
    hosts.add_argument("--role", choices=("prefill", "decode"), default=None,
                       help="this host's side: decode listens (--listen), prefill links to it (--peer)")
    _two_host_flags(hosts, "decode", "prefill", "the decode side's address", "to speak again, and for one "
                    "transfer call")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser(
        "bench", help="throughput sweep: block size x data plane x direction vs an in-run memcpy",
        description=f"Measure push_blocks / pull_blocks between processes of this host "
                    f"({', '.join(planes.names())}) and the local copy_blocks for each block size, against a "
                    "bare memcpy loop over the same descriptors measured in the same run; print GB/s, us "
                    "per block and the ratio to the baseline, write every duration as JSON.")
    bench.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES),
                       help="block sizes, comma-separated (default "
                            f"{','.join(short_size(s) for s in DEFAULT_SIZES)})")
    bench.add_argument("--planes", type=_list_of(plane_aliases(), "unknown data plane"), default=None,
                       help=f"data planes, comma-separated: {', '.join(all_planes())} ({plane_help}); "
                            f"default: all that this host permits")
    bench.add_argument("--directions", type=_list_of({"push": "push", "pull": "pull", "both": tuple(DIRECTIONS)},
                                                     "unknown direction"),
                       default=list(DIRECTIONS), help="push, pull or both (default both; local is a copy)")
    bench.add_argument("--total", type=_size, default=DEFAULT_TOTAL,
                       help=f"bytes moved per call (default {short_size(DEFAULT_TOTAL)}; at least one block)")
    bench.add_argument("--min-time", type=_seconds, default=DEFAULT_MIN_TIME,
                       help=f"seconds of calls per point and kind (default {DEFAULT_MIN_TIME:g})")
    bench.add_argument("--gpu", choices=GPU_MODES, default="auto",
                       help="GPU rows (copy_blocks D2D, swap_blocks D2H/H2D, push/pull over cuda_ipc and "
                            "staging, each vs a baseline of the same bytes and the issue's target; one 4 KiB "
                            "push's median and p99 over cuda_ipc): auto = "
                            "where a runtime whose memory the host cannot address (cuda) is usable, else "
                            "skipped with the reason; off; only = just these rows (default auto)")
    bench.add_argument("--gpu-sizes", type=_sizes, default=list(GPU_SIZES),
                       help="block sizes of the GPU rows (default "
                            f"{','.join(short_size(s) for s in GPU_SIZES)})")
    bench.add_argument("--gpu-total", type=_size, default=GPU_TOTAL,
                       help=f"bytes moved per call in the GPU rows (default {short_size(GPU_TOTAL)}: the blocks "
                            "of half a cache twice that size)")
    bench.add_argument("--json", metavar="FILE", default=None,
                       help="where to write the raw results (default llm_datadist-bench-<date>-<time>.json "
                            "in the current directory)")
    bench.add_argument("--plot", metavar="FILE.png", default=None,
                       help="draw GB/s against block size (needs matplotlib: pip install 'llm_datadist[plot]')")
    hosts = bench.add_argument_group(
        "two hosts", "the table between this host and another: the server serves the caches that transfers "
                     "reach, the client measures (its planes, its memcpy baseline) and prints the table")
    hosts.add_argument("--role", choices=("server", "client"), default=None,
                       help="this host's side: server listens (--listen), client links to it (--peer) and takes "
                            "the sweep's flags (default planes there: local and tcp; no GPU rows)")
    _two_host_flags(hosts, "server", "client", "the server's address", "to speak again")
    bench.set_defaults(func=_bench)

    info = sub.add_parser("info", help="version, build, device runtimes, data planes of this host")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)
    return parser


#: Exit status after Ctrl-C, as a shell reports a process killed by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        # The command's cluster processes were closed on the way here (they ignore Ctrl-C
        # themselves: _console.sigint_for_parent_only); one line instead of a traceback.
        print(f"{args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
