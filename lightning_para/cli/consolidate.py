"""``lightning-para consolidate DIR [--output_file FILE]`` (also ``python -m lightning_para.cli.consolidate``): one
Trainer-loadable file from a sharded checkpoint folder, with the arguments of Lightning's
``lightning.pytorch.utilities.consolidate_checkpoint``. The library function is
:func:`lightning_para.checkpoint.consolidate_checkpoint`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from lightning_para.checkpoint.consolidate import consolidate_checkpoint


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-para consolidate DIR [--output_file FILE]``: one Trainer-loadable file (0 on success)."""
    parser = argparse.ArgumentParser(prog="lightning-para consolidate", description=main.__doc__)
    parser.add_argument("checkpoint_folder", type=Path)
    parser.add_argument("--output_file", type=Path, default=None)
    args = parser.parse_args(argv)
    output = args.output_file or args.checkpoint_folder.with_suffix(args.checkpoint_folder.suffix + ".consolidated")
    if output.exists():
        parser.error(f"{output} exists already; choose another --output_file or move it away.")
    consolidate_checkpoint(args.checkpoint_folder, output)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
