#!/usr/bin/env python3
"""Finds registers that an sm_90a kernel overwrites while a wgmma may still read them.

A wgmma with its A operand in registers reads them until a `wgmma.wait_group` covers its group;
ptxas does not hold those registers for it, and once the value in them is dead gives them to
other values. A write to them before that wait is a race: it went unnoticed in the 8-bit
attention kernel while the write came late in its softmax, and gave wrong outputs once it came
early. This scans the SASS in program order: for every HGMMA / QGMMA / IGMMA whose second
operand is a register, it follows the instructions after it until a WARPGROUP.DEPBAR.LE gsb0, N
with at least N groups committed after its own, and reports the first one that writes one of
its four A registers.

Usage: cuobjdump -sass kernel.o | python scripts/wgmma_register_hazards.py
(cuobjdump comes with the CUDA toolkit; exit status 1 when a hazard is found)
"""

import re
import sys

ADDRESS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
A_REGISTER = re.compile(r"[HQI]GMMA\S*\s+R\d+,\s+R(\d+),")
WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s+0x([0-9a-f]+)")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def functions(sass):
    """{name: [(address, instruction)]} of cuobjdump -sass text."""
    out, name = {}, None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :", 1)[1].strip()
            out[name] = []
            continue
        m = ADDRESS.match(line)
        if m and name is not None:
            out[name].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def destination(instruction):
    """The register an instruction writes first (None for wgmma, waits and stores)."""
    body = PREDICATE.sub("", instruction)
    parts = body.split(None, 1)
    if len(parts) < 2 or "GMMA" in parts[0] or parts[0].startswith(("ST", "WARPGROUP", "BRA", "SYNCS")):
        return None
    return parts[1].split(",")[0].strip().split(".")[0]


def commits(instruction):
    return "GMMA" in instruction and "gsb0" in instruction


def hazards(instructions):
    """[(wgmma address, writing address, writing instruction)] of one function."""
    found = []
    for i, (address, instruction) in enumerate(instructions):
        m = A_REGISTER.search(instruction)
        if not m:
            continue
        first = int(m.group(1))
        registers = {f"R{first + k}" for k in range(4)}
        end = next((j for j in range(i, len(instructions)) if commits(instructions[j][1])), len(instructions) - 1)
        later_groups = 0
        for j in range(i + 1, len(instructions)):
            at, other = instructions[j]
            if j > end and commits(other):
                later_groups += 1
            wait = WAIT.search(other)
            if wait and j > end and later_groups >= int(wait.group(1), 16):
                break  # all but the newest N groups are done: this one is among them
            if destination(other) in registers:
                found.append((address, at, other))
                break
    return found


def main():
    total = 0
    for name, instructions in functions(sys.stdin.read()).items():
        for address, at, other in hazards(instructions):
            total += 1
            print(f"{name}: the wgmma at {address:#x} still reads what {at:#x} writes: {other}")
    print(f"{total} hazard(s)")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
