"""tools/kernel_report.py: dflash's Triton kernels compiled for a GPU on a machine without one. Its reading of a
machine-code listing (the loops, a trip's instructions, spill and tensor-core instructions, inner or not) on a
hand-made listing; where Triton is installed, the whole tool on small shapes: every kernel stage two warms
compiles for sm_90 as its launch specializes it."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import kernel_report  # noqa: E402

LISTING = """
        .text.dkdv_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_CTAID.X ;
.L_x_0:
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_1:
        /*0030*/                   LDL R4, [R1+0x8] ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0050*/              @!P0 STL [R1+0x8], R4 ;
        /*0060*/               @P1 BRA `(.L_x_1) ;
        /*0070*/                   FMUL R5, R5, 0.5 ;
        /*0080*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0090*/              @!P0 BRA `(.L_x_0) ;
        /*00a0*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00b0*/                   EXIT ;
.L_x_3:
        /*00c0*/                   BRA `(.L_x_3);
"""


def test_loops_of_a_listing_are_its_back_branches_with_one_trips_counts():
    instructions, labels = kernel_report.parse_sass(LISTING)
    assert len(instructions) == 13 and labels == {".L_x_0": 0x20, ".L_x_1": 0x30, ".L_x_2": 0xb0, ".L_x_3": 0xc0}
    assert kernel_report.opcode("@!P0 STL [R1+0x8], R4") == "STL"
    assert kernel_report.opcode("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT") == "HGMMA"
    found = kernel_report.loops(LISTING)  # the forward branch and the trap's branch to itself are no loops
    assert found == [
        {"start": "0x30", "end": "0x60", "instructions": 4, "spill_ops": 2, "mma_ops": 1, "inner": True},
        {"start": "0x20", "end": "0x90", "instructions": 8, "spill_ops": 2, "mma_ops": 1, "inner": False},
    ]
    assert kernel_report.inner_loops({"loops": found}) == "4/2/1"


def test_options_are_checked_with_the_option_named():
    assert kernel_report.parse_head_shapes("9:3:64,32:8:128") == [(9, 3, 64), (32, 8, 128)]
    with pytest.raises(SystemExit, match="--heads"):
        kernel_report.parse_head_shapes("9:3")
    configs = kernel_report.parse_configs("dkdv=64,64,8,2;forward=64,32,4,3")
    assert configs["dkdv"].warps == 8 and configs["forward"].keys == 32
    with pytest.raises(SystemExit, match="forward, dq or dkdv"):
        kernel_report.parse_configs("attention=64,64,4,3")
    with pytest.raises(SystemExit, match="dq=ROWS,KEYS,WARPS,STAGES"):
        kernel_report.parse_configs("dq=64,64")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (a GPU install's package)")
def test_every_kernel_stage_two_warms_compiles_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "kernels.json"
    assert kernel_report.main(["--heads", "4:2:64", "--vocabs", "1024", "--configs", "dkdv=64,64,4,2",
                               "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["kernels"]
    assert [row["kernel"] for row in rows] == ["forward_kernel", "dq_kernel", "dkdv_kernel", "_ce_grad_loop_kernel",
                                               "_adamw_kernel", "_adamw_kernel"]
    dkdv = rows[2]
    assert dkdv["constants"]["GROUP"] == 2 and dkdv["num_warps"] == 4 and dkdv["num_stages"] == 2
    assert dkdv["registers"] > 0 and dkdv["instructions"] > 0 and dkdv["compile_s"] > 0
    inner = [loop for loop in dkdv["loops"] if loop["inner"]]
    outer = [loop for loop in dkdv["loops"] if not loop["inner"]]
    # the row tiles' loop, inside the runtime loop over the query heads
    assert len(inner) == 1 and inner[0]["mma_ops"] > 0 and len(outer) == 1
    assert outer[0]["instructions"] > inner[0]["instructions"]
    from triton.runtime.driver import driver

    assert getattr(driver, "_active", None) is None or not isinstance(driver._active, kernel_report.CompileOnlyDriver)
