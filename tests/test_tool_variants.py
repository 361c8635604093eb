"""The GPU timing tools' variant tables build on any machine: every named variant of tools/gpu/batch_check.py
and ab_decode.py is a valid configuration of today's defaults (a variant that replaces one field of a
default config can become invalid when another default moves: batch_check.py then stops before timing
anything, on the device), and bench_moe_grouped.py's variants and labels are valid and distinct."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu"))


def test_batch_check_variants_build():
    import batch_check  # noqa: PLC0415 - tools/gpu on sys.path above

    table = batch_check._variants()
    assert "grouped tables l1" in table and len(table) > 10
    for name, sets in table.items():
        assert sets or name == "default", name  # each variant but the default changes something


def test_ab_decode_switches_are_valid():
    import ab_decode  # noqa: PLC0415

    assert "tail torch" in ab_decode.SWITCHES
    assert all(ab_decode.SWITCHES.values())


def test_bench_moe_grouped_labels_distinct():
    import bench_moe_grouped as bmg  # noqa: PLC0415

    labels = [bmg.gu_label(c) for c in bmg.GU_VARIANTS]
    # the engine's config first (the mma gate/up, both tables in 32 copies), then the dp4a one as it was to
    # session 27 (16 copies); the latest variants are told apart by their labels
    assert bmg.GU_VARIANTS[0].mma and " x64" in labels[0] and "mma" in labels[0]
    assert not bmg.GU_VARIANTS[1].mma and " x16" in labels[1] and labels[1] != labels[0]
    assert len(set(labels[-8:])) == 8


def test_ncu_top_ranks_stall_lines(tmp_path):
    """tools/gpu/ncu_top.py reads an ncu source-page CSV after its ==PROF== lines and ranks the SASS lines by
    stall samples, naming each line's largest reasons."""
    import ncu_top  # noqa: PLC0415

    f = tmp_path / "sass.csv"
    f.write_text(
        "==PROF== Connected\n"
        '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_wait"\n'
        '"0x10","IMAD R3, R1","25","0","25"\n'
        '"0x20","LDS R1, [R2]","75","60","15"\n'
    )
    out = ncu_top.top(str(f), 5)
    assert out[0].endswith("2 SASS lines, 100 stall samples")
    assert "75.0 %" in out[1] and "LDS" in out[1] and "long_sb 60" in out[1]
    assert "IMAD" in out[2] and "wait 25" in out[2]
