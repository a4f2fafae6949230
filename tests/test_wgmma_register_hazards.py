"""scripts/wgmma_register_hazards.py: a write to a wgmma's A registers before the wait that
covers its group is found; writes after that wait, or to other registers, are not."""

import importlib.util
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
spec = importlib.util.spec_from_file_location("wgmma_register_hazards",
                                              os.path.join(ROOT, "scripts", "wgmma_register_hazards.py"))
scan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scan)

PV = "QGMMA.64x136x32.F32.E4M3.E4M3 R24, R156, gdesc[UR20], R24, gsb0"
S = "IGMMA.64x128x32.S8.S8 R92, gdesc[UR20], R92, gsb0"


def sass(*instructions):
    body = "".join(f"        /*{16 * i:04x}*/                   {t} ;  /* 0x0 */\n" for i, t in enumerate(instructions))
    return "\t\tFunction : kernel\n" + body


@pytest.mark.parametrize("instructions, expected", [
    ((PV, "FADD R157, R1, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0"), 1),           # written while read
    ((PV, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "FADD R157, R1, R2"), 0),           # after its wait
    ((PV, "FADD R160, R1, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0"), 0),           # not an A register
    ((PV, S, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FADD R156, R1, R2"), 0),        # one later group may wait
    ((S, PV, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "@!P0 PRMT R159, R1, 0x5410, R2"), 1),  # its group may wait
])
def test_hazards(instructions, expected):
    found = [h for insts in scan.functions(sass(*instructions)).values() for h in scan.hazards(insts)]
    assert len(found) == expected
