"""The forwarding shim of the CPU fast path: a minimal x86-64 ELF shared object, written byte by byte.

For each ``cblas_X`` it exports a 6-byte ``jmp *GOT`` stub whose GOT slot the dynamic linker fills with
``scipy_cblas_X`` (an ``R_X86_64_GLOB_DAT`` relocation), i.e. exactly what a compiled forwarding shim
would contain; ``cblas_sgemm`` is a small hand-assembled dispatcher that sends one-row products to
sgemv. Why a shim at all, and how it is cached, self-tested and loaded: :mod:`engine.runtime.cpu.blas`.
This module only computes bytes: no files, no ctypes, no MLX.

Layout (file offset == virtual address):
  page 0, read+execute: ELF header, program headers, .hash, .dynsym, .dynstr, .rela.dyn, .text
  page 1, read+write:   .dynamic, .got
  not loaded:           .shstrtab and the section headers (only for tools such as nm/readelf)
.text holds one ``jmp *slot(%rip)`` per exported name, except ``cblas_sgemm``, which is the small
dispatcher below; .got holds one slot per imported target (the ``scipy_`` names, plus
``scipy_cblas_sgemv`` for the dispatcher), filled at load time by an R_X86_64_GLOB_DAT relocation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# scipy-openblas32 prefixes every symbol it exports; the shim forwards cblas_X to this prefix + cblas_X.
OPENBLAS_SYMBOL_PREFIX = "scipy_"
SHIM_SONAME = "libvelox_cblas_shim.so"

_PAGE = 0x1000
_ELF_HEADER_SIZE = 64
_PROGRAM_HEADER_SIZE = 56
_SECTION_HEADER_SIZE = 64
_SYMBOL_SIZE = 24
_RELA_SIZE = 24
_FUNCTION_ALIGNMENT = 8  # each function starts 8-aligned: a 6-byte jmp stub is padded with 2 int3

_PT_LOAD, _PT_DYNAMIC, _PT_GNU_STACK = 1, 2, 0x6474E551
_PF_X, _PF_W, _PF_R = 1, 2, 4
_DT = {"NULL": 0, "NEEDED": 1, "HASH": 4, "STRTAB": 5, "SYMTAB": 6, "RELA": 7, "RELASZ": 8,
       "RELAENT": 9, "STRSZ": 10, "SYMENT": 11, "SONAME": 14}  # fmt: skip
_SHT_PROGBITS, _SHT_STRTAB, _SHT_RELA, _SHT_HASH, _SHT_DYNAMIC, _SHT_DYNSYM = 1, 3, 4, 5, 6, 11
_SHF_WRITE, _SHF_ALLOC, _SHF_EXECINSTR = 1, 2, 4
_STB_GLOBAL_STT_FUNC = (1 << 4) | 2
_R_X86_64_GLOB_DAT = 6
_EM_X86_64 = 62
_ET_DYN = 3
_TEXT_SECTION_INDEX = 5


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _program_header(kind: int, flags: int, offset: int, size: int, alignment: int) -> bytes:
    """An Elf64_Phdr for a segment whose file offset, virtual and physical address are all ``offset``."""
    return struct.pack("<IIQQQQQQ", kind, flags, offset, offset, offset, size, size, alignment)


def _sysv_elf_hash(name: bytes) -> int:
    """The System V ABI symbol hash used by DT_HASH tables."""
    value = 0
    for byte in name:
        value = ((value << 4) + byte) & 0xFFFFFFFF
        high = value & 0xF0000000
        if high:
            value ^= high >> 24
        value &= ~high & 0xFFFFFFFF
    return value


class _StringTable:
    def __init__(self) -> None:
        self.data = bytearray(b"\0")
        self._offsets: dict[str, int] = {"": 0}

    def add(self, text: str) -> int:
        if text not in self._offsets:
            self._offsets[text] = len(self.data)
            self.data += text.encode() + b"\0"
        return self._offsets[text]


# A tiny assembler for the shim's code. A program is a list of (item, assembly) pairs, where the item is
# the instruction's encoding (bytes), a label, a short jump to a label, or a tail call through the GOT
# slot of an imported function; the assembly text documents each encoding (``objdump -d`` prints it).
@dataclass(frozen=True)
class _Label:
    name: str


@dataclass(frozen=True)
class _ShortJump:
    """``jcc rel8`` / ``jmp rel8``: the opcode byte, then the signed displacement from the next instruction."""

    opcode: int
    label: str


@dataclass(frozen=True)
class _GotJump:
    """``jmp *disp32(%rip)`` (FF 25 disp32) through the GOT slot of ``symbol``: a tail call."""

    symbol: str


_Instruction = bytes | _Label | _ShortJump | _GotJump
_JE, _JNE, _JLE, _JMP = 0x74, 0x75, 0x7E, 0xEB


def _instruction_size(item: _Instruction) -> int:
    if isinstance(item, bytes):
        return len(item)
    return {_Label: 0, _ShortJump: 2, _GotJump: 6}[type(item)]


def _program_size(program: list[tuple[_Instruction, str]]) -> int:
    return sum(_instruction_size(item) for item, _ in program)


def _assemble(program: list[tuple[_Instruction, str]], address: int, got_slots: dict[str, int]) -> bytes:
    """Encode ``program`` to run at ``address``; ``got_slots`` maps imported names to slot addresses.
    Displacements are relative to the address of the next instruction, as the CPU computes them."""
    labels: dict[str, int] = {}
    position = address
    for item, _ in program:
        if isinstance(item, _Label):
            labels[item.name] = position
        position += _instruction_size(item)
    code = bytearray()
    for item, assembly in program:
        next_address = address + len(code) + _instruction_size(item)
        if isinstance(item, bytes):
            code += item
        elif isinstance(item, _ShortJump):
            displacement = labels[item.label] - next_address
            if not -128 <= displacement <= 127:
                raise ValueError(f"short jump out of range: {assembly}")
            code += bytes([item.opcode]) + struct.pack("<b", displacement)
        elif isinstance(item, _GotJump):
            code += b"\xff\x25" + struct.pack("<i", got_slots[item.symbol] - next_address)
    return bytes(code)


_SGEMV_TARGET = OPENBLAS_SYMBOL_PREFIX + "cblas_sgemv"

# The exported cblas_sgemm. One-row products (decode: x[1xK] @ W.T or x @ W) go to OpenBLAS's sgemv,
# which, unlike its sgemm with M == 1, can use more than one thread and does not fall off a cliff for
# large weights. Measured single-threaded (scipy-openblas32 0.3.34, AMD EPYC, AVX-512 kernels):
# x @ W.T with W 49152x576: sgemm 15.5 ms, sgemv 7.9 ms; 1536x576: 430 -> 260 us; 576x576 and
# 576x1536: equal within noise; 256..1152 x 576: sgemv ~5% slower (a few us). x @ W with W 576x49152:
# sgemm 26.9 ms, sgemv 4.2 ms; 576x1536: 286 -> 164 us. Everything else goes to sgemm.
#
# With Order == RowMajor (101), M == 1 and TransA == NoTrans (111), C's one row of N is
# alpha * A[0, :K] (contiguous) * op(B) + beta * C[0, :N], which is, as a row-major sgemv:
#   TransB == Trans (112), B is N x K:    sgemv(101, NoTrans, m=N, n=K, alpha, B, ldb, A, 1, beta, C, 1)
#   TransB == NoTrans (111), B is K x N:  sgemv(101, Trans,   m=K, n=N, alpha, B, ldb, A, 1, beta, C, 1)
# lda and ldc do not matter for one row. N and K must be positive: sgemv returns before scaling y when
# m or n is 0, whereas sgemm still sets C = beta * C when K == 0 (and reports bad sizes itself).
# beta == 0: MLX leaves C uninitialised (possibly NaN) and passes beta = 0; OpenBLAS's gemv then zeroes y
# instead of computing 0 * NaN (OpenBLAS's own utest sgemv 0_nan_inf asserts this; measured with
# scipy-openblas32 0.3.34 on every shape from 1x1 to 49152x576, 1 and 2 threads, both transposes), so
# beta == 0 needs no special case. The self-test re-checks it with NaN-filled outputs on each machine.
#
# SysV ABI at entry: sgemm(Order=edi, TransA=esi, TransB=edx, M=ecx, N=r8d, K=r9d, alpha=xmm0,
# beta=xmm1, stack: 8(%rsp)=A, 16=lda, 24=B, 32=ldb, 40=C, 48=ldc) and sgemv(Order=edi, Trans=esi,
# M=edx, N=ecx, A=r8, lda=r9d, alpha=xmm0, beta=xmm1, stack: 8(%rsp)=X, 16=incX, 24=Y, 32=incY).
# The tail call rewrites our own stack-argument area in place (it belongs to the callee under the ABI):
# X = A already sits at 8(%rsp); edi (RowMajor), xmm0 and xmm1 carry over unchanged.
_SGEMM_DISPATCHER: list[tuple[_Instruction, str]] = [
    (b"\x83\xff\x65", "cmp    $101, %edi           # Order == CblasRowMajor?"),
    (_ShortJump(_JNE, "sgemm"), "jne    sgemm"),
    (b"\x83\xf9\x01", "cmp    $1, %ecx             # M == 1?"),
    (_ShortJump(_JNE, "sgemm"), "jne    sgemm"),
    (b"\x83\xfe\x6f", "cmp    $111, %esi           # TransA == CblasNoTrans?"),
    (_ShortJump(_JNE, "sgemm"), "jne    sgemm"),
    (b"\x45\x85\xc0", "test   %r8d, %r8d           # N > 0?"),
    (_ShortJump(_JLE, "sgemm"), "jle    sgemm"),
    (b"\x45\x85\xc9", "test   %r9d, %r9d           # K > 0?"),
    (_ShortJump(_JLE, "sgemm"), "jle    sgemm"),
    (b"\x83\xfa\x70", "cmp    $112, %edx           # TransB == CblasTrans?"),
    (_ShortJump(_JE, "b_is_n_by_k"), "je     b_is_n_by_k"),
    (b"\x83\xfa\x6f", "cmp    $111, %edx           # TransB == CblasNoTrans?"),
    (_ShortJump(_JNE, "sgemm"), "jne    sgemm"),
    # B is K x N: y = B^T x.
    (b"\xbe\x70\x00\x00\x00", "mov    $112, %esi           # sgemv Trans = CblasTrans"),
    (b"\x44\x89\xca", "mov    %r9d, %edx           # sgemv M = K"),
    (b"\x44\x89\xc1", "mov    %r8d, %ecx           # sgemv N = N"),
    (_ShortJump(_JMP, "sgemv"), "jmp    sgemv"),
    # B is N x K: y = B x; sgemv Trans stays in %esi (TransA == CblasNoTrans).
    (_Label("b_is_n_by_k"), "b_is_n_by_k:"),
    (b"\x44\x89\xc2", "mov    %r8d, %edx           # sgemv M = N"),
    (b"\x44\x89\xc9", "mov    %r9d, %ecx           # sgemv N = K"),
    (_Label("sgemv"), "sgemv:"),
    (b"\x4c\x8b\x44\x24\x18", "mov    0x18(%rsp), %r8      # sgemv A = B"),
    (b"\x44\x8b\x4c\x24\x20", "mov    0x20(%rsp), %r9d     # sgemv lda = ldb"),
    (b"\x48\x8b\x44\x24\x28", "mov    0x28(%rsp), %rax     # C"),
    (b"\x48\x89\x44\x24\x18", "mov    %rax, 0x18(%rsp)     # sgemv Y = C"),
    (b"\x48\xc7\x44\x24\x10\x01\x00\x00\x00", "movq   $1, 0x10(%rsp)       # sgemv incX = 1"),
    (b"\x48\xc7\x44\x24\x20\x01\x00\x00\x00", "movq   $1, 0x20(%rsp)       # sgemv incY = 1"),
    (_GotJump(_SGEMV_TARGET), "jmp    *scipy_cblas_sgemv@GOT(%rip)"),
    (_Label("sgemm"), "sgemm:"),
    (_GotJump(OPENBLAS_SYMBOL_PREFIX + "cblas_sgemm"), "jmp    *scipy_cblas_sgemm@GOT(%rip)"),
]


def _function_program(exported_name: str, dispatch_single_row_sgemm: bool) -> list[tuple[_Instruction, str]]:
    """The code behind one exported name: the sgemm dispatcher, or a plain forwarding jump."""
    if exported_name == "cblas_sgemm" and dispatch_single_row_sgemm:
        return _SGEMM_DISPATCHER
    target = OPENBLAS_SYMBOL_PREFIX + exported_name
    return [(_GotJump(target), f"jmp    *{target}@GOT(%rip)")]


def build_forwarding_shim(
    needed_library: str, exported_names: tuple[str, ...], *, dispatch_single_row_sgemm: bool = True
) -> bytes:
    """Bytes of an x86-64 shared object exporting each name as a jump to ``scipy_`` + name.

    ``needed_library`` (an absolute path) becomes the shim's DT_NEEDED, so loading the shim also
    loads OpenBLAS and the relocations always find their targets. With ``dispatch_single_row_sgemm``
    (the default), ``cblas_sgemm`` is the dispatcher :data:`_SGEMM_DISPATCHER` instead of a plain jump.
    """
    programs = [_function_program(name, dispatch_single_row_sgemm) for name in exported_names]
    imported_names = _jump_targets(programs)
    import_count = len(imported_names)
    dynstr = _StringTable()
    needed_offset = dynstr.add(needed_library)
    soname_offset = dynstr.add(SHIM_SONAME)
    # Symbol 0 is the null symbol, then the imported targets (undefined), then the exported functions.
    target_name_offsets = [dynstr.add(name) for name in imported_names]
    export_name_offsets = [dynstr.add(name) for name in exported_names]
    symbol_names = [b""] + [name.encode() for name in imported_names] + [n.encode() for n in exported_names]
    symbol_count = len(symbol_names)
    hash_table = _hash_table(symbol_names)

    program_header_count = 4
    hash_offset = _align(_ELF_HEADER_SIZE + program_header_count * _PROGRAM_HEADER_SIZE, 8)
    dynsym_offset = _align(hash_offset + len(hash_table), 8)
    dynstr_offset = dynsym_offset + symbol_count * _SYMBOL_SIZE
    rela_offset = _align(dynstr_offset + len(dynstr.data), 8)
    text_offset = _align(rela_offset + import_count * _RELA_SIZE, 16)
    function_addresses, text_end = _function_layout(programs, text_offset)
    # The read+execute segment ends at text_end however long .text is; the writable one starts a page on.
    dynamic_offset = _align(text_end, _PAGE)
    dynamic_entries = [
        ("NEEDED", needed_offset),
        ("SONAME", soname_offset),
        ("HASH", hash_offset),
        ("STRTAB", dynstr_offset),
        ("SYMTAB", dynsym_offset),
        ("STRSZ", len(dynstr.data)),
        ("SYMENT", _SYMBOL_SIZE),
        ("RELA", rela_offset),
        ("RELASZ", import_count * _RELA_SIZE),
        ("RELAENT", _RELA_SIZE),
        ("NULL", 0),
    ]
    dynamic = b"".join(struct.pack("<qQ", _DT[tag], value) for tag, value in dynamic_entries)
    got_offset = dynamic_offset + len(dynamic)
    writable_end = got_offset + import_count * 8
    got_slots = {name: got_offset + index * 8 for index, name in enumerate(imported_names)}

    symbols = _dynamic_symbols(target_name_offsets, export_name_offsets, function_addresses, programs)
    relocations = b"".join(
        # symbol 1 + index in .dynsym is imported_names[index]
        struct.pack("<QQq", got_slots[name], ((1 + index) << 32) | _R_X86_64_GLOB_DAT, 0)
        for index, name in enumerate(imported_names)
    )
    text = bytearray(b"\xcc" * (text_end - text_offset))  # int3 fills the gaps between functions
    for address, program in zip(function_addresses, programs, strict=True):
        code = _assemble(program, address, got_slots)
        text[address - text_offset : address - text_offset + len(code)] = code

    section_specs = [  # name, type, flags, offset, size, link, info, alignment, entry size
        ("", 0, 0, 0, 0, 0, 0, 0, 0),
        (".hash", _SHT_HASH, _SHF_ALLOC, hash_offset, len(hash_table), 2, 0, 8, 4),
        (".dynsym", _SHT_DYNSYM, _SHF_ALLOC, dynsym_offset, len(symbols), 3, 1, 8, _SYMBOL_SIZE),
        (".dynstr", _SHT_STRTAB, _SHF_ALLOC, dynstr_offset, len(dynstr.data), 0, 0, 1, 0),
        (".rela.dyn", _SHT_RELA, _SHF_ALLOC, rela_offset, len(relocations), 2, 0, 8, _RELA_SIZE),
        (".text", _SHT_PROGBITS, _SHF_ALLOC | _SHF_EXECINSTR, text_offset, len(text), 0, 0, 16, 0),
        (".dynamic", _SHT_DYNAMIC, _SHF_ALLOC | _SHF_WRITE, dynamic_offset, len(dynamic), 3, 0, 8, 16),
        (".got", _SHT_PROGBITS, _SHF_ALLOC | _SHF_WRITE, got_offset, import_count * 8, 0, 0, 8, 8),
        (".shstrtab", _SHT_STRTAB, 0, 0, 0, 0, 0, 1, 0),
    ]
    shstrtab_offset = writable_end
    shstrtab, section_headers = _section_headers(section_specs, shstrtab_offset)
    section_headers_offset = _align(shstrtab_offset + len(shstrtab), 8)

    writable_size = writable_end - dynamic_offset
    program_headers = b"".join(
        [
            _program_header(_PT_LOAD, _PF_R | _PF_X, 0, text_end, _PAGE),
            _program_header(_PT_LOAD, _PF_R | _PF_W, dynamic_offset, writable_size, _PAGE),
            _program_header(_PT_DYNAMIC, _PF_R | _PF_W, dynamic_offset, len(dynamic), 8),
            # A non-executable stack: without this header glibc would demand an executable stack.
            _program_header(_PT_GNU_STACK, _PF_R | _PF_W, 0, 0, 16),
        ]
    )
    elf_header = _elf_header(section_headers_offset, program_header_count, len(section_specs))

    image = bytearray(section_headers_offset + len(section_headers))
    for offset, blob in [
        (0, elf_header),
        (_ELF_HEADER_SIZE, program_headers),
        (hash_offset, hash_table),
        (dynsym_offset, symbols),
        (dynstr_offset, dynstr.data),
        (rela_offset, relocations),
        (text_offset, text),
        (dynamic_offset, dynamic),
        (shstrtab_offset, shstrtab),
        (section_headers_offset, section_headers),
    ]:
        image[offset : offset + len(blob)] = blob
    return bytes(image)


def _jump_targets(programs: list[list[tuple[_Instruction, str]]]) -> list[str]:
    """Every function the code jumps to, in order of first use: the scipy_ name of each export, plus
    scipy_cblas_sgemv for the dispatcher when cblas_sgemv itself is not exported. One GOT slot each."""
    names: list[str] = []
    for program in programs:
        for item, _ in program:
            if isinstance(item, _GotJump) and item.symbol not in names:
                names.append(item.symbol)
    return names


def _function_layout(programs: list[list[tuple[_Instruction, str]]], text_offset: int) -> tuple[list[int], int]:
    """(each function's address, the end of .text). Functions follow each other, each starting
    _FUNCTION_ALIGNMENT-aligned; their sizes do not depend on where they go, so the layout is known before
    any displacement is computed."""
    addresses = []
    end = text_offset
    for program in programs:
        end = _align(end, _FUNCTION_ALIGNMENT)
        addresses.append(end)
        end += _program_size(program)
    return addresses, _align(end, _FUNCTION_ALIGNMENT)


def _dynamic_symbols(
    target_name_offsets: list[int],
    export_name_offsets: list[int],
    function_addresses: list[int],
    programs: list[list[tuple[_Instruction, str]]],
) -> bytes:
    """.dynsym: the null symbol, the imported targets (undefined), then the exported functions."""
    symbols = bytearray(_SYMBOL_SIZE)
    for name_offset in target_name_offsets:
        symbols += struct.pack("<IBBHQQ", name_offset, _STB_GLOBAL_STT_FUNC, 0, 0, 0, 0)
    for name_offset, address, program in zip(export_name_offsets, function_addresses, programs, strict=True):
        symbols += struct.pack("<IBBHQQ", name_offset, _STB_GLOBAL_STT_FUNC, 0, _TEXT_SECTION_INDEX,
                               address, _program_size(program))  # fmt: skip
    return bytes(symbols)


def _hash_table(symbol_names: list[bytes]) -> bytes:
    """The DT_HASH table: one bucket per symbol, chains linking the symbols that share a bucket."""
    count = len(symbol_names)
    buckets = [0] * count
    chains = [0] * count
    for index in range(1, count):  # symbol 0 is the null symbol
        bucket = _sysv_elf_hash(symbol_names[index]) % count
        chains[index] = buckets[bucket]
        buckets[bucket] = index
    return struct.pack(f"<{2 + 2 * count}I", count, count, *buckets, *chains)


def _section_headers(section_specs: list[tuple], shstrtab_offset: int) -> tuple[bytes, bytes]:
    """(.shstrtab, the section header table) for `section_specs`; .shstrtab itself sits at
    `shstrtab_offset`. Sections that are loaded have their file offset as address."""
    shstrtab = _StringTable()
    for spec in section_specs:
        shstrtab.add(spec[0])
    headers = bytearray()
    for name, kind, flags, offset, size, link, info, alignment, entry_size in section_specs:
        if name == ".shstrtab":
            offset, size = shstrtab_offset, len(shstrtab.data)
        address = offset if flags & _SHF_ALLOC else 0
        headers += struct.pack("<IIQQQQIIQQ", shstrtab.add(name), kind, flags, address, offset,
                               size, link, info, alignment, entry_size)  # fmt: skip
    return bytes(shstrtab.data), bytes(headers)


def _elf_header(section_headers_offset: int, program_header_count: int, section_count: int) -> bytes:
    """The 64-byte Elf64_Ehdr of a little-endian x86-64 shared object (SysV ABI) with no entry point;
    the last section is .shstrtab."""
    identification = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, SysV
    return identification + struct.pack(
        "<HHIQQQIHHHHHH", _ET_DYN, _EM_X86_64, 1, 0, _ELF_HEADER_SIZE, section_headers_offset, 0,
        _ELF_HEADER_SIZE, _PROGRAM_HEADER_SIZE, program_header_count, _SECTION_HEADER_SIZE,
        section_count, section_count - 1,
    )  # fmt: skip
