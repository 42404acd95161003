"""`segcache mtp extract`: write a checkpoint's MTP head next to an mlx-lm conversion."""

from __future__ import annotations

import argparse
import sys

from ..errors import SegcacheError


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `mtp` subcommand on an argparse `subparsers` object."""
    p = subparsers.add_parser(
        "mtp", help="multi-token-prediction heads: extract one from a checkpoint",
        description="mlx-lm drops a checkpoint's mtp.* tensors when it converts it. `extract` "
        "reads them from the original checkpoint and writes mtp.safetensors into the mlx-lm "
        "model directory, quantized like the model, where segcache finds it.")
    actions = p.add_subparsers(dest="mtp_command", required=True)
    ex = actions.add_parser("extract", help="write the MTP head of CHECKPOINT_DIR into MODEL_DIR")
    ex.add_argument("--from", dest="source", required=True, metavar="CHECKPOINT_DIR",
                    help="the original checkpoint (directory or .safetensors file with mtp.* tensors)")
    ex.add_argument("--to", dest="target", required=True, metavar="MODEL_DIR",
                    help="the mlx-lm conversion of the same model")
    ex.add_argument("--bits", type=int, help="quantization bits (default: the model's; float "
                    "if the model is not quantized)")
    ex.add_argument("--group-size", type=int, help="quantization group size (default: the model's)")
    ex.add_argument("--mode", help="quantization mode (default: the model's, else affine)")
    p.set_defaults(handler=run)
    return p


def run(args) -> int:
    from .weights import extract  # mlx and mlx-lm: only when the command runs

    try:
        done = extract(args.source, args.target, bits=args.bits, group_size=args.group_size,
                       mode=args.mode)
    except SegcacheError as e:
        print(f"segcache mtp extract: {e}", file=sys.stderr)
        return 2
    q = done["quantization"]
    how = f"{q['bits']}-bit, group {q['group_size']}, {q['mode']}" if q else f"float ({done['dtype']})"
    print(f"wrote {done['path']}: {done['layers']} layer(s), {done['parameters']:,} parameters, {how}")
    return 0
