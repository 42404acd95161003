"""The `segcache` command line: demo, generate, serve, check, store, mtp."""

from __future__ import annotations

import argparse
import sys

from . import BLAS, __version__


def _store(args) -> int:
    from .store import cli as store_cli

    return store_cli.main(args.store_args)


def _demo(args) -> int:
    from . import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="segcache",
        description="Segmented copy-on-write cache runtime for MLX / mlx-lm.",
        epilog=f"BLAS: {BLAS}",
    )
    parser.add_argument("--version", action="version", version=f"segcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the built-in demonstration")
    from .demo import add_arguments

    add_arguments(demo)
    demo.set_defaults(handler=_demo)

    from . import cli_generate

    cli_generate.add_parser(sub)

    from .serve import cli as serve_cli

    serve_cli.add_parser(sub)

    from . import cli_check

    cli_check.add_parser(sub)

    from .mtp import cli as mtp_cli

    mtp_cli.add_parser(sub)

    store = sub.add_parser(
        "store", help="inspect a prefix store: stats | ls | verify | gc PATH [--max-bytes N]", add_help=False
    )
    store.add_argument("store_args", nargs=argparse.REMAINDER)
    store.set_defaults(handler=_store)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["store"]:  # the store CLI parses its own arguments, --help included
        from .store import cli as store_cli

        return store_cli.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
