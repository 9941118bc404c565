"""How a compiled kernel sits on a GPU we do not have, read from its resources and machine code.

`blocks_per_sm`: how many of its blocks (CTAs) an SM holds at once, from registers per thread, warps and
shared memory, by the rule of the CUDA occupancy calculator (cuda_occupancy.h, cudaOccMaxActiveBlocksPerSM:
registers are given to warps in units of 256 from each of the SM's four sub-partitions of 16,384; threads up
to 2,048 an SM; shared memory in units of 128 bytes plus 1 KiB the driver reserves per block, out of the
largest carveout, 164 KiB on an A100 and 228 KiB on an H100; at most 32 blocks an SM on both; sm_86/89/120 below). `waves`: how
many rounds of that many blocks per SM a grid takes. `loop_counts`: the instructions of a kernel's main
loop (the one with the most matrix instructions) by kind, from `cuobjdump -sass`: what one trip, one chunk
of the delta rule's walk, chains; `kernel_counts` the same over a whole kernel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SmLimits:
    shared_bytes: int            # the largest shared-memory carveout of an SM
    max_blocks: int = 32         # resident blocks an SM holds at most
    registers: int = 65536       # 32-bit registers of an SM (and at most of one block)
    sub_partitions: int = 4      # each holds a quarter of the registers and of the warps
    register_unit: int = 256     # registers are given to a warp in multiples of this
    max_threads: int = 2048
    shared_unit: int = 128       # shared memory is given to a block in multiples of this
    shared_reserved: int = 1024  # bytes per block the driver keeps (since sm_80)


# sm_86, sm_89, sm_120 (GeForce / workstation / L4, L40S): 100 KiB of shared memory and 1,536 threads an SM, 16
# (sm_86) or 24 blocks (NVIDIA CCCL's cuda/__device/arch_traits.h).
SM_LIMITS = {80: SmLimits(shared_bytes=164 * 1024), 90: SmLimits(shared_bytes=228 * 1024),
             100: SmLimits(shared_bytes=228 * 1024),
             86: SmLimits(shared_bytes=100 * 1024, max_blocks=16, max_threads=1536),
             89: SmLimits(shared_bytes=100 * 1024, max_blocks=24, max_threads=1536),
             120: SmLimits(shared_bytes=100 * 1024, max_blocks=24, max_threads=1536)}


def blocks_per_sm(arch: int, registers: int, num_warps: int, shared_bytes: int) -> tuple[int, str]:
    """(resident blocks per SM, what limits them: "registers", "threads", "shared" or "blocks")."""
    limits = SM_LIMITS[arch]
    per_warp = -(-registers * 32 // limits.register_unit) * limits.register_unit
    warps_per_partition = limits.registers // limits.sub_partitions // per_warp
    shared = -(-(shared_bytes + limits.shared_reserved) // limits.shared_unit) * limits.shared_unit
    by = {"registers": warps_per_partition * limits.sub_partitions // num_warps,
          "threads": limits.max_threads // (32 * num_warps),
          "shared": limits.shared_bytes // shared,
          "blocks": limits.max_blocks}
    fewest = min(by.values())
    return fewest, next(name for name, n in by.items() if n == fewest)


def waves(programs: int, num_sms: int, per_sm: int) -> int:
    """Rounds a grid of `programs` blocks takes on `num_sms` SMs holding `per_sm` blocks each."""
    return -(-programs // (num_sms * per_sm)) if per_sm else 0


# Kinds of instructions counted in a loop: a predicate on the opcode (mnemonic with its modifiers).
SASS_KINDS = {
    "HGMMA": lambda op: op.startswith("HGMMA"),            # Hopper warpgroup matrix multiply (wgmma)
    "HMMA": lambda op: op.startswith("HMMA"),              # warp-level tensor-core matrix multiply (mma.sync)
    "BAR.SYNC": lambda op: op.startswith("BAR.SYNC"),      # block-wide barrier
    "LDS": lambda op: op.split(".")[0] in ("LDS", "LDSM"),   # shared-memory loads (LDSM: ldmatrix)
    "STS": lambda op: op.split(".")[0] in ("STS", "STSM"),   # shared-memory stores (STSM: stmatrix)
    "LDGSTS": lambda op: op.startswith("LDGSTS"),          # cp.async: global -> shared, the loop's pipelined loads
    "LDG": lambda op: op.startswith("LDG.") or op == "LDG",
    "FFMA": lambda op: op.startswith("FFMA"),
}
_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


def sass_instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each instruction in `cuobjdump -sass` output."""
    return [(int(m.group(1), 16), m.group(2), m.group(3).strip()) for m in _INSTRUCTION.finditer(sass)]


def counts(opcodes: list[str]) -> dict[str, int]:
    """SASS_KINDS counted over these opcodes, and "instructions": all of them."""
    found = {kind: sum(test(op) for op in opcodes) for kind, test in SASS_KINDS.items()}
    found["instructions"] = len(opcodes)
    return found


def kernel_counts(sass: str) -> dict[str, int]:
    """SASS_KINDS over the whole kernel (for a kernel without a loop, such as the delta rule's prep)."""
    return counts([op for _, op, _ in sass_instructions(sass)])


def loop_bodies(sass: str) -> list[list[tuple[int, str, str]]]:
    """The instructions of each loop: from a backward branch's target to the branch. Not loops: the trailing
    `BRA self` after EXIT, and a branch back from a block placed after the kernel's EXIT (ptxas puts rarely
    taken paths there: a forward branch jumps to the block, whose branch back spans the EXIT)."""
    code = sass_instructions(sass)
    loops = []
    for address, opcode, operands in code:
        target = _BRANCH_TARGET.search(operands)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) <= address:
            loops.append([ins for ins in code if int(target.group(1), 16) <= ins[0] <= address])
    return [body for body in loops if len(body) > 1 and not any(op.startswith("EXIT") for _, op, _ in body)]


def loop_counts(sass: str) -> dict[str, int] | None:
    """Counts of SASS_KINDS (and "instructions": all of them) in the body of the loop that holds the most
    matrix instructions. None when the code has no loop."""
    loops = [[op for _, op, _ in body] for body in loop_bodies(sass)]
    if not loops:
        return None
    matrix = lambda body: sum(SASS_KINDS["HGMMA"](op) or SASS_KINDS["HMMA"](op) for op in body)  # noqa: E731
    return counts(max(loops, key=lambda b: (matrix(b), len(b))))


def local_accesses(sass: str) -> tuple[int, int]:
    """(loads and stores of local memory in the kernel, those of them inside a loop). A kernel that spills
    parks registers there: outside every loop that is a few accesses a program; inside one, some every trip."""
    is_local = lambda op: op.split(".")[0] in ("LDL", "STL")  # noqa: E731
    everywhere = {address for address, op, _ in sass_instructions(sass) if is_local(op)}
    in_loops = {address for body in loop_bodies(sass) for address, op, _ in body if is_local(op)}
    return len(everywhere), len(in_loops)
