"""Names in generated C and CUDA: every identifier is minted here, never copied.

User names (program and tensor names) are data. They reach generated files only
- inside ``//`` comments, escaped by :func:`comment_text`, and
- as the readable tail of a minted parameter name (:func:`param_names`), reduced to
  ``[A-Za-z0-9_]`` and behind a prefix and an index that make it unique.

Entry points are global C symbols, so they carry a prefix and, by default, the
program's ABI (the dtype and shape of every argument): two instantiations of one
program (say batch 1 and batch 8) link into one binary, and a build that pairs a
header with the wrong object fails to link instead of running the wrong kernel.
A name the user chooses (``--name``) is checked against C, C++ and CUDA keywords,
reserved spellings and the names of the C, C++ and CUDA libraries
(:data:`RESERVED`), and against the prefixes this module mints from (``mg_``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import DType, TensorType

ENTRY_PREFIX = "mirage_"
# A default entry name longer than this ends in a hash of its signature instead.
MAX_ENTRY_LEN = 120
# Suffixes the header appends to the entry name (functions and constants).
ENTRY_SUFFIXES = ("_workspace_bytes", "_checked")

_C_KEYWORDS = """
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char16_t
char32_t char8_t class compl concept const const_cast consteval constexpr constinit
continue co_await co_return co_yield decltype default delete do double dynamic_cast else
enum explicit export extern false float for friend goto if inline int long mutable
namespace new noexcept not not_eq nullptr operator or or_eq private protected public
register reinterpret_cast requires restrict return short signed sizeof static
static_assert static_cast struct switch template this thread_local throw true try typedef
typeid typename union unsigned using virtual void volatile wchar_t while xor xor_eq
_Alignas _Alignof _Atomic _Bool _Complex _Generic _Imaginary _Noreturn _Static_assert
_Thread_local typeof typeof_unqual final override import module
"""
# The C standard library (functions and macros of <stdlib.h>, <stdio.h>, <string.h>,
# <math.h>, <assert.h>, <errno.h>, <signal.h>, <setjmp.h>, <time.h>, <ctype.h>, ...)
# and common POSIX names a header may see.
_C_LIBRARY = """
abort abs acos acosf acosh acoshf asin asinf asinh asinhf assert atan atan2 atan2f atanf
atanh atanhf atexit atof atoi atol atoll bsearch calloc cbrt cbrtf ceil ceilf clearerr
clock copysign copysignf cos cosf cosh coshf ctime difftime div erf erfc erfcf erff errno
exit exp exp10 exp10f exp2 exp2f expf expm1 expm1f fabs fabsf fclose fdim fdimf feof
ferror fflush fgetc fgets floor floorf fma fmaf fmax fmaxf fmin fminf fmod fmodf fopen
fprintf fputc fputs fread free freopen frexp frexpf fscanf fseek ftell fwrite getc getchar
getenv gets hypot hypotf ilogb ilogbf isalnum isalpha isdigit isfinite isinf islower isnan
isspace isupper jmp_buf labs ldexp ldexpf ldiv lgamma lgammaf llabs llrint llround log
log10 log10f log1p log1pf log2 log2f logb logbf logf longjmp lrint lround malloc memchr
memcmp memcpy memmove memset mktime modf modff nan nanf nearbyint nextafter perror pow
powf printf putc putchar puts qsort raise rand realloc remainder remove rename rewind rint
rintf round roundf scalbn scanf setjmp setvbuf signal sin sincos sincosf sinf sinh sinhf
snprintf sprintf sqrt sqrtf srand sscanf strcat strchr strcmp strcpy strerror strlen
strncat strncmp strncpy strrchr strstr strtod strtof strtok strtol strtoul system tan tanf
tanh tanhf tgamma tgammaf time tmpfile tolower toupper trunc truncf ungetc vfprintf
vprintf vsnprintf vsprintf main read write open close stdin stdout stderr
NULL EOF BUFSIZ FILE EXIT_SUCCESS EXIT_FAILURE INFINITY NAN HUGE_VAL RAND_MAX
size_t ptrdiff_t intptr_t uintptr_t int8_t int16_t int32_t int64_t uint8_t uint16_t
uint32_t uint64_t wint_t max_align_t nullptr_t offsetof va_list va_start va_end va_arg
std min max
"""
# CUDA: built-in variables, vector types, runtime types and intrinsics a header or a
# kernel can see (the cuda*/cu*/nv* prefixes are refused wholesale below).
_CUDA = """
threadIdx blockIdx blockDim gridDim warpSize dim3 char1 char2 char3 char4 uchar1 uchar2
uchar3 uchar4 short1 short2 short3 short4 ushort1 ushort2 ushort3 ushort4 int1 int2 int3
int4 uint1 uint2 uint3 uint4 long1 long2 long3 long4 ulong1 ulong2 ulong3 ulong4 longlong1
longlong2 longlong3 longlong4 ulonglong1 ulonglong2 ulonglong3 ulonglong4 float1 float2
float3 float4 double1 double2 double3 double4 half half2 bfloat16 atomicAdd atomicMax
atomicMin atomicCAS atomicExch clock64 printf assert syncthreads make_float2 make_float4
make_int2 make_int4 rsqrt rsqrtf saturate __syncthreads __shfl_sync __ldg
"""

RESERVED = frozenset((_C_KEYWORDS + _C_LIBRARY + _CUDA).split())
_RESERVED_PREFIXES = ("mg_", "cuda", "cu", "nv", "__", "CU", "NV")


def is_safe_identifier(name: str) -> bool:
    """A name that can be a global C symbol of ours: an ASCII identifier, not reserved
    by C, C++ or CUDA (no ``_`` + capital, no ``__`` anywhere), not a library name,
    and outside the namespaces codegen mints from."""
    return (re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) is not None
            and "__" not in name and name not in RESERVED
            and not name.startswith(_RESERVED_PREFIXES))


def check_entry_name(name: str) -> str:
    """A user-chosen entry-point name (``--name``), or a diagnostic (exit 2)."""
    if not is_safe_identifier(name):
        raise MirageError(
            f"--name {comment_text(name)!r} cannot be an entry point: use ASCII letters, "
            f"digits and single '_', starting with a letter; not a C/C++/CUDA keyword "
            f"or library name; not starting with 'mg_', 'cu', 'cuda' or 'nv'")
    if name.endswith(ENTRY_SUFFIXES) or len(name) > 200:
        raise MirageError(f"--name {name!r}: names ending in {' or '.join(ENTRY_SUFFIXES)} "
                          f"(or longer than 200 characters) are reserved for generated "
                          f"symbols")
    return name


def sanitize(text: str, limit: int = 32) -> str:
    """``text`` reduced to ``[A-Za-z0-9]`` runs joined by single ``_`` (at most
    ``limit`` characters); '' when nothing is left."""
    runs = re.findall(r"[A-Za-z0-9]+", text.encode("ascii", "ignore").decode())
    return "_".join(runs)[:limit].strip("_")


_DTYPE_LETTER = {DType.F16: "h", DType.BF16: "b", DType.F32: "f"}


def abi_signature(inputs: Sequence[TensorType], outputs: Sequence[TensorType]) -> str:
    """The dtype and shape of every argument: ``h16x4096_h4096x6144_to_h16x6144``."""
    def one(t: TensorType) -> str:
        return _DTYPE_LETTER[t.dtype] + "x".join(str(d) for d in t.shape)
    return "_".join(one(t) for t in inputs) + "_to_" + "_".join(one(t) for t in outputs)


def default_entry_name(program: str, inputs: Sequence[TensorType],
                       outputs: Sequence[TensorType]) -> str:
    """``mirage_<program>_<ABI signature>``; the signature is a 12-digit hash when the
    name would be longer than :data:`MAX_ENTRY_LEN`."""
    base = ENTRY_PREFIX + (sanitize(program) or "program")
    sig = abi_signature(inputs, outputs)
    name = f"{base}_{sig}"
    if len(name) > MAX_ENTRY_LEN:
        name = f"{base}_{hashlib.sha256(sig.encode()).hexdigest()[:12]}"
    return name


def kernel_name(entry: str, index: int) -> str:
    """The ``index``-th kernel of ``entry``: in the ``mg_`` namespace, unique per entry."""
    return f"mg_k{index}_{entry}"


def param_names(inputs: Sequence[str], outputs: Sequence[str]) -> tuple[list[str], list[str]]:
    """Entry-point parameter names: ``mg_in<k>_<name>`` and ``mg_out<k>_<name>``. The
    prefix keeps them clear of user macros and of each other; the tensor name, reduced
    to safe characters, is only there to be read."""
    def one(kind: str, k: int, name: str) -> str:
        tail = sanitize(name, 24)
        return f"mg_{kind}{k}_{tail}" if tail else f"mg_{kind}{k}"
    return ([one("in", k, n) for k, n in enumerate(inputs)],
            [one("out", k, n) for k, n in enumerate(outputs)])


def comment_text(text: str) -> str:
    """``text`` safe inside a ``//`` comment and on a terminal: printable ASCII except
    ``\\`` (a line splice at the end of a line) and ``?`` (``??/`` is a trigraph for
    ``\\``) is kept; everything else becomes ``\\xNN`` / ``\\u{NNNN}``."""
    out: list[str] = []
    for ch in text:
        c = ord(ch)
        if 0x20 <= c < 0x7F and ch not in "\\?":
            out.append(ch)
        elif c < 0x100:
            out.append(f"\\x{c:02x}")
        else:
            out.append(f"\\u{{{c:04x}}}")
    return "".join(out)
