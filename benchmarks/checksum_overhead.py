"""What per-shard checksums cost (issue 24): hash speeds on this CPU, and the save/load time of the
GPT demo model (``recipes/gpt-cpu-demo.yaml``'s ``preset: tiny``, with Adam state) with and without them.

One process, no process group (DCP's single-process path: the same writer and the same files as one
rank's share). Variants alternate over rounds; ratios are medians of per-round ratios, measured in
the same run. ``python benchmarks/checksum_overhead.py [--rounds 7]``
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lightning_para.checkpoint.atomic import checkpoint_problems, data_problems, write_marker
from lightning_para.checkpoint.checksums import ChecksummingWriter, file_checksum
from lightning_para.recipes import GPT


def hash_speeds(size: int = 64 << 20) -> dict[str, float]:
    data = os.urandom(size)
    functions = {
        "crc32": zlib.crc32, "adler32": zlib.adler32, "sha1": lambda d: hashlib.sha1(d).digest(),
        "sha256": lambda d: hashlib.sha256(d).digest(), "blake2b": lambda d: hashlib.blake2b(d).digest(),
    }
    speeds = {}
    for name, function in functions.items():
        best = min(_timed(function, data) for _ in range(3))
        speeds[name] = size / best / 1e6
    return speeds


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def demo_state() -> dict:
    model = GPT(preset="tiny")
    model.configure_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    optimizer.step()
    return {"state_dict": model.state_dict(), "optimizer_0": optimizer.state_dict()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for name, speed in hash_speeds().items():
        print(f"{name:8s} {speed:7.0f} MB/s")
    state = demo_state()
    nbytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor))
    print(f"demo state: {nbytes / 1e6:.1f} MB")
    root = Path(tempfile.mkdtemp())
    save_ratios, pass_ratios, load_ratios = [], [], []
    times = {"plain": [], "checksums": [], "hash_pass": [], "load": [], "verify": []}
    for r in range(args.rounds):
        plain, checked = root / f"plain{r}", root / f"checked{r}"
        t_plain = _timed(lambda: dcp.save(state, checkpoint_id=str(plain), no_dist=True))
        t_hash = _timed(lambda: [file_checksum(f) for f in plain.glob("*.distcp")])  # the pass alone
        writer = ChecksummingWriter(checked)
        t_checked = _timed(lambda: dcp.save(state, storage_writer=writer, checkpoint_id=str(checked), no_dist=True))
        write_marker(checked, {}, writer.checksums)
        t_load = _timed(lambda: dcp.load(state, checkpoint_id=str(checked), no_dist=True))
        t_verify = _timed(lambda: data_problems(checkpoint_problems(checked)))
        for key, value in zip(times, (t_plain, t_checked, t_hash, t_load, t_verify)):
            times[key].append(value)
        save_ratios.append(t_checked / t_plain)
        pass_ratios.append((t_plain + t_hash) / t_plain)
        load_ratios.append((t_load + t_verify) / t_load)
        shutil.rmtree(plain)
        shutil.rmtree(checked)
    shutil.rmtree(root)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"save: plain DCP {med['plain']:.1f} ms, ChecksummingWriter {med['checksums']:.1f} ms;"
          f" ratio median {statistics.median(save_ratios):.3f} (range {min(save_ratios):.3f}-{max(save_ratios):.3f})")
    print(f"      the hash pass alone {med['hash_pass']:.1f} ms: (save + pass) / save median"
          f" {statistics.median(pass_ratios):.3f} (range {min(pass_ratios):.3f}-{max(pass_ratios):.3f})")
    print(f"load: DCP {med['load']:.1f} ms, verification {med['verify']:.1f} ms;"
          f" ratio median {statistics.median(load_ratios):.3f} (range {min(load_ratios):.3f}-{max(load_ratios):.3f})")


if __name__ == "__main__":
    main()
