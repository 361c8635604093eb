"""ds4-make-model: write a synthetic DS4-layout GGUF (tiny for tests, full-size Flash for benchmarks).

    ds4-make-model --preset tiny --quant q2 -o tiny.gguf
    ds4-make-model --preset flash --quant q2 --sparse-experts -o flash-q2-sparse.gguf   # ~3 GB on disk
    ds4-make-model --preset flash --quant q2 --max-bytes 4G -o /tmp/prefix.gguf       # throughput probe

The header, metadata and tensor directory are packed here (gguf supplies only the type codes; packing
the 256k tokenizer strings directly is much faster than GGUFWriter); the tensor data is streamed chunk
by chunk from ds4.tools.synthetic (so a file and build_weights() hold the same bytes) with flat
memory. --sparse-experts leaves the routed-expert tensors as holes: all-zero bytes are valid zero blocks
in every expert format, so the file is a complete, valid model that costs only its non-expert bytes.
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import shutil
import signal
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ds4 import config
from ds4.config import ModelConfig
from ds4.layout import QUANT_MIXES
from ds4.tools import synthetic
from ds4.tools.synthetic import PlannedTensor

ALIGNMENT = 32

_SCALAR_KINDS = {
    "str": gguf.GGUFValueType.STRING,
    "u32": gguf.GGUFValueType.UINT32,
    "u64": gguf.GGUFValueType.UINT64,
    "f32": gguf.GGUFValueType.FLOAT32,
    "bool": gguf.GGUFValueType.BOOL,
}
_ARRAY_KINDS = {
    "u32[]": gguf.GGUFValueType.UINT32,
    "i32[]": gguf.GGUFValueType.INT32,
    "f32[]": gguf.GGUFValueType.FLOAT32,
    "str[]": gguf.GGUFValueType.STRING,
}


@dataclass
class WriteStats:
    path: Path
    planned_data_bytes: int  # tensor data incl. alignment padding, as if fully written
    file_bytes: int  # logical file size
    written_bytes: int  # tensor bytes actually generated and written (holes and skipped prefix excluded)
    seconds: float
    peak_rss_bytes: int
    complete: bool  # False when --max-bytes stopped early

    @property
    def mb_per_s(self) -> float:
        return self.written_bytes / 1e6 / max(self.seconds, 1e-9)


def pad(n: int, align: int = ALIGNMENT) -> int:
    return -(-n // align) * align


def planned_data_bytes(planned: Sequence[PlannedTensor], align: int = ALIGNMENT) -> int:
    """Size of the tensor-data section: every tensor padded to the alignment."""
    return sum(pad(pt.nbytes, align) for pt in planned)


def parse_size(text: str) -> int:
    """'4G', '500M', '123' -> bytes (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in units else t)
    except ValueError:
        raise ValueError(f"bad size {text!r}: expected a number with an optional K/M/G/T suffix") from None
    if value < 0:
        raise ValueError(f"bad size {text!r}: must be >= 0")
    return int(value * mult)


def encode_header(
    cfg: ModelConfig, planned: Sequence[PlannedTensor], align: int = ALIGNMENT, tokenizer: bool = True
) -> bytes:
    """GGUF v3 header, metadata and tensor directory (no padding to the data start).

    tokenizer=False omits the tokenizer.ggml.* keys (for test configs with a reduced vocabulary).
    """
    meta = synthetic.synthetic_metadata(cfg)
    if tokenizer:
        meta += synthetic.tokenizer_metadata(cfg.n_vocab)
    out = [struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, len(planned), len(meta))]
    for key, kind, value in meta:
        out.append(_pack_str(key))
        if kind in _SCALAR_KINDS:
            vt = _SCALAR_KINDS[kind]
            out.append(struct.pack("<I", vt) + _pack_scalar(vt, value))
        else:
            vt = _ARRAY_KINDS[kind]
            out.append(struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, vt, len(value)))
            if vt == gguf.GGUFValueType.STRING:
                out.extend(_pack_str(v) for v in value)
            else:
                out.append(np.asarray(value, dtype=_NP_ITEM[vt]).tobytes())
    offset = 0
    for pt in planned:
        dims = pt.spec.dims
        entry = struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, int(pt.qtype), offset)
        out.append(_pack_str(pt.name) + entry)
        offset += pad(pt.nbytes, align)
    return b"".join(out)


_VT = gguf.GGUFValueType
_NP_ITEM = {_VT.UINT32: "<u4", _VT.INT32: "<i4", _VT.FLOAT32: "<f4"}
_STRUCT = {_VT.UINT32: "<I", _VT.UINT64: "<Q", _VT.FLOAT32: "<f", _VT.BOOL: "<?"}


def _pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pack_scalar(vt: gguf.GGUFValueType, value) -> bytes:
    return _pack_str(value) if vt == gguf.GGUFValueType.STRING else struct.pack(_STRUCT[vt], value)


def write_model(
    path: str | os.PathLike,
    cfg: ModelConfig,
    quant: str,
    *,
    seed: int,
    sparse_experts: bool = False,
    max_bytes: int | None = None,
    tokenizer: bool = True,
    log=None,
) -> WriteStats:
    """Write a synthetic GGUF to `path` (directly; callers wanting atomicity pass a temp name)."""
    path = Path(path)
    planned = synthetic.plan(cfg, quant)
    total = planned_data_bytes(planned)
    _check_disk(path, planned, sparse_experts, max_bytes)
    t0 = time.perf_counter()
    header = encode_header(cfg, planned, tokenizer=tokenizer)
    data_start = pad(len(header))
    with open(path, "wb") as fout:
        fout.write(header + bytes(data_start - len(header)))
        written, complete = _write_data(fout, planned, cfg, seed, data_start, sparse_experts, max_bytes, log)
        end = fout.tell() if not complete else data_start + total
        fout.truncate(end)  # also materialises trailing holes
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return WriteStats(path, total, end, written, seconds, rss, complete)


def _write_data(fout, planned, cfg, seed, data_start, sparse_experts, max_bytes, log) -> tuple[int, bool]:
    """Stream every tensor at its aligned offset; a writer thread overlaps disk I/O with generation."""
    q: queue.Queue = queue.Queue(maxsize=4)
    error: list[BaseException] = []

    def drain() -> None:
        while (item := q.get()) is not None:
            try:
                if isinstance(item, int):
                    fout.seek(item)
                else:
                    fout.write(item)
            except BaseException as exc:  # surfaced in the main thread below
                error.append(exc)

    th = threading.Thread(target=drain, daemon=True)
    th.start()
    offset, written, next_report = data_start, 0, 1 << 30
    complete = True
    try:
        for pt in planned:
            q.put(offset)
            if not (sparse_experts and pt.is_routed_expert):
                for chunk in synthetic.iter_chunks(pt, cfg, seed=seed):
                    if error:
                        raise error[0]
                    q.put(chunk.numpy())  # the array keeps the chunk alive until written
                    written += chunk.numel()
                    if max_bytes is not None and written >= max_bytes:
                        complete = False
                        break
            if not complete:
                break
            nbytes = pad(pt.nbytes)
            if not (sparse_experts and pt.is_routed_expert):
                q.put(bytes(nbytes - pt.nbytes))
            offset += nbytes
            if log and written >= next_report:
                log(f"  {written / 2**30:7.2f} GiB written, at {pt.name}")
                next_report = written + (1 << 30)
    finally:
        q.put(None)
        th.join()
    if error:
        raise error[0]
    return written, complete


def _check_disk(path: Path, planned, sparse_experts: bool, max_bytes: int | None) -> None:
    need = sum(pad(pt.nbytes) for pt in planned if not (sparse_experts and pt.is_routed_expert))
    if max_bytes is not None:
        need = min(need, max_bytes)
    need += 64 << 20  # header
    where = path.parent.resolve()
    if not where.is_dir():
        raise OSError(f"output directory does not exist: {where}")
    free = shutil.disk_usage(where).free
    if need > free:
        raise OSError(
            f"not enough disk space in {where}: need {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free "
            "(use --sparse-experts or --max-bytes)"
        )


def write_model_atomic(path: str | os.PathLike, cfg: ModelConfig, quant: str, **kw) -> WriteStats:
    """write_model into a temp name in the same directory, then rename (readers never see half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        stats = write_model(tmp, cfg, quant, **kw)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    stats.path = path
    return stats


def tiny_model_path(quant: str = config.TINY_MODEL_QUANT, seed: int = config.TINY_MODEL_SEED) -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("ds4")) / f"tiny-{quant}-s{seed}.gguf"


def ensure_tiny_model(quant: str = config.TINY_MODEL_QUANT, seed: int = config.TINY_MODEL_SEED) -> Path:
    """The cached tiny synthetic model (built once, atomically; used by `-m tiny`)."""
    if quant not in QUANT_MIXES:
        raise ValueError(f"unknown quant mix {quant!r}; expected one of {', '.join(QUANT_MIXES)}")
    path = tiny_model_path(quant, seed)
    if not path.exists() or synthetic_version(path) != synthetic.GENERATOR_VERSION:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model_atomic(path, config.TINY, quant, seed=seed)
    return path


_VERSION_KEY = b"general.ds4_synthetic_version"


def synthetic_version(path: Path) -> int | None:
    """The generator version a cached synthetic file was written with (None if absent or unreadable).

    The key sits in the first few hundred bytes, so this reads only the head of the file.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    at = head.find(_VERSION_KEY)
    if at < 0 or at + len(_VERSION_KEY) + 8 > len(head):
        return None
    vtype, value = struct.unpack_from("<II", head, at + len(_VERSION_KEY))
    return value if vtype == gguf.GGUFValueType.UINT32 else None


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4-make-model", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(config.PRESETS), default="tiny")
    p.add_argument("--quant", choices=QUANT_MIXES, default="q2")
    p.add_argument("--seed", type=int, default=config.TINY_MODEL_SEED)
    p.add_argument("-o", "--output", help="output GGUF path")
    p.add_argument(
        "--sparse-experts",
        action="store_true",
        help="leave routed-expert tensors as holes (valid zero blocks, almost no disk)",
    )
    p.add_argument("--max-bytes", help="stop after this much tensor data (e.g. 4G): a throughput probe")
    p.add_argument("--plan", action="store_true", help="print the planned sizes and exit without writing")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = config.PRESETS[args.preset]
    planned = synthetic.plan(cfg, args.quant)
    total = planned_data_bytes(planned)
    experts = sum(pad(pt.nbytes) for pt in planned if pt.is_routed_expert)
    say = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr))
    say(
        f"{args.preset} {args.quant}: {len(planned)} tensors, {total / 2**30:.2f} GiB tensor data "
        f"({experts / 2**30:.2f} GiB routed experts)"
    )
    if args.plan:
        return 0
    if not args.output:
        print("ds4-make-model: error: -o/--output FILE is required (or use --plan)", file=sys.stderr)
        return 2
    # A kill (SIGTERM) must still run write_model_atomic's cleanup: a stray temp can be tens of GB.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if in_main else None
    try:
        max_bytes = parse_size(args.max_bytes) if args.max_bytes else None
        stats = write_model_atomic(
            args.output,
            cfg,
            args.quant,
            seed=args.seed,
            sparse_experts=args.sparse_experts,
            max_bytes=max_bytes,
            log=say,
        )
    except (OSError, ValueError) as exc:
        print(f"ds4-make-model: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    state = "complete" if stats.complete else "PREFIX ONLY (stopped by --max-bytes; not a loadable model)"
    say(
        f"wrote {stats.path}: {stats.file_bytes / 2**30:.3f} GiB file, {state}; "
        f"{stats.written_bytes / 1e6:.1f} MB generated in {stats.seconds:.2f} s = {stats.mb_per_s:.1f} MB/s; "
        f"peak RSS {stats.peak_rss_bytes / 2**20:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
