"""A decoding step's hot loops on a CPU in C (cpu_decoding.c says why and how): `attend`,
which kernels.attention calls for a step's few queries; `add_norm`, a residual connection's
add and LayerNorm (kernels.add_norm); `put_slots` and `keep_slots`, which write a step's
keys and values into the decoder's cache and compact it in place (kv_cache.py); `linear`,
products of a few rows with a weight packed once (kernels.Linear); and `best_extensions`,
beam search's best candidates of each sentence (transformer/decoding/beams.py).

Builds (`BUILDS`): the C source is compiled for one instruction set, the fastest this CPU
runs unless `select` names another: "avx512" (AVX-512F, 16 floats a vector), "avx2" (AVX2
and FMA, 8), "portable" (the architecture's baseline, SSE2 or NEON, 4), or "torch": no C
kernels. A build compiled for a wider vector than the CPU's registers would run as scalar
code, so each is its own library. It is compiled at first use into the user's cache
(`$XDG_CACHE_HOME/transformer-mt/`, else `~/.cache/transformer-mt/`), under a name that
hashes the source, the compiler, its flags and the CPU, so that a changed kernel, a new
compiler or another machine sharing the home directory builds its own; a build is written
under a temporary name and renamed into place, so that processes building at once never
load half a file. It links the OpenMP runtime that torch already loaded (GCC's libgomp:
one pool of threads for torch's ops and these), or builds without OpenMP where the
compiler has none or its OpenMP build does not load (Clang without libomp), and then runs
only with one thread. Without a C compiler, or where the build fails, they decline (one
warning says why: the slow path) and their callers keep torch's ops: attention's two
batched products, an add and layer_norm, copies, torch's products, an add and topk; the
same results to rounding (topk: the same, ties aside), slower. Builds differ from each
other in rounding only.

`attend` declines (returns None) what it was not built for: other dtypes, more than
MAX_QUERIES queries or MAX_HEAD dimensions per head, a last dimension that is not contiguous,
a mask broadcast along the keys. `best_extensions`, `add_norm` and `linear` decline
anything but contiguous fp32 (add_norm: without gradients, a width that is a multiple of 16;
linear: panels packed for another width).

Keys in tiles: `attend` reads keys as rows (..., L, d_k), or, faster, as `tile_keys` lays
them out: 16 keys at a time transposed, (..., ceil(L / 16), d_k, 16), the layout its score
loop reads (cpu_decoding.c says why), in every build. The decoder's caches keep their keys
so wherever kernels.reads_tiles says this kernel will read them (kv_cache.py);
`untile_keys` gives rows back for any other reader.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
MAX_QUERIES, MAX_HEAD, MAX_KEYS = 8, 128, 1 << 14  # as the C source's MAXM, MAXD; stack room
TILE = 16  # keys per tile, outputs per panel: the C source's T
FLAGS = ["-O3", "-fno-math-errno", "-fPIC", "-shared"]
BUILDS = ("avx512", "avx2", "portable")  # fastest first
# The instruction sets each build needs (names as cpu_flags gives them) and its flags: -march
# =native for the host's other extensions and tuning, less AVX-512 for the AVX2 build; the
# portable build for the architecture's baseline, which any compiler default may exceed.
NEEDS = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}, "portable": set()}
_X86 = platform.machine().lower() in ("x86_64", "amd64")
BUILD_FLAGS = {
    "avx512": ["-march=native"],
    "avx2": ["-march=native", "-mno-avx512f"],
    "portable": ["-march=x86-64", "-mtune=generic"] if _X86 else [],
}

_wanted: str | None = None  # `select`'s build; None: the fastest this CPU runs
_built: dict[str, tuple[ctypes.CDLL | None, bool]] = {}  # each build tried: (library, OpenMP)
# The build in use, resolved at the first call after `select`:
_library: ctypes.CDLL | None = None
_loaded = "torch"  # the build in `_library`, or "torch"
_parallel = False  # built with OpenMP
_tried = False


def cpu_flags() -> set[str]:
    """The CPU's instruction-set extensions (torch's cpuinfo; /proc/cpuinfo on a torch
    without it), lowercase and without underscores, where the two spellings meet: torch's
    "avx512_f" and Linux's "avx512f" are "avx512f"; "fma" for FMA3."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        flags = [name for name, on in capabilities().items() if on is True]
    else:
        lines = [line for line in _cpuinfo() if line.startswith("flags")]
        flags = lines[0].split(":")[1].split() if lines else []
    flags = {_flag(name) for name in flags}
    return flags | ({"fma"} if "fma3" in flags else set())


def _flag(name: str) -> str:
    """An instruction set's name as cpu_flags gives it."""
    return name.lower().replace("_", "")


def runnable() -> list[str]:
    """The builds this CPU can run, fastest first, then "torch" (no C kernels)."""
    flags = cpu_flags()
    return [b for b in BUILDS if NEEDS[b] <= flags and (_X86 or not NEEDS[b])] + ["torch"]


def select(build: str | None) -> None:
    """Load `build` (one of BUILDS, or "torch": torch's ops) from the next call on; None:
    the fastest this CPU runs. A build this CPU cannot run is a ValueError that says why."""
    global _wanted, _library, _loaded, _parallel, _tried
    if build is not None and build not in runnable():
        if build not in (*BUILDS, "torch"):
            raise ValueError(f"no C kernel build {build!r}: choose from {(*BUILDS, 'torch')}")
        missing = ", ".join(sorted(NEEDS[build] - cpu_flags())) or "x86"
        raise ValueError(
            f"this CPU cannot run the {build} build (no {missing}); it runs: "
            f"{', '.join(runnable())}"
        )
    _wanted, _library, _loaded, _parallel, _tried = build, None, "torch", False, False


def build() -> str:
    """The build that runs: one of BUILDS, or "torch" (none loaded, or none could be)."""
    library()
    return _loaded


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor | None:
    """softmax(q k^T / sqrt(d_k) + mask) v for q (B, h, M, d_k), k, v (B, h, L, d_k) (k may
    be in tiles: `tile_keys`) and a mask broadcast to (B, h, M, L), additive or boolean
    (True: may attend; the encoder's, where a batch has a few source tokens); None where
    the kernel does not take these inputs (see the module docstring) or could not be built.
    The result (B, h, M, d_k) lies in memory as (B, M, h, d_k): each query's heads side by
    side, concatenated for W^O without a copy (model.py)."""
    lib, threads = _ready()
    if lib is None or not _takes(q, k, v, mask):
        return None
    (b, h, m, d), n, tiled = q.shape, v.shape[2], k.dim() == 5
    out = q.new_empty(b, m, h, d)  # returned as (b, h, m, d): strides (m h d, d, h d)
    strides = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], 0, 0, 0, 0, m * h * d, d, h * d]
    if mask is not None:
        if mask.dtype == torch.bool:  # additive
            mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
        broadcast = zip(mask.shape, mask.stride(), strict=True)  # a dimension of 1: stride 0
        strides[13 - mask.dim() : 13] = [0 if size == 1 else step for size, step in broadcast]
    lib.attend(
        b, h, m, n, d, tiled, d**-0.5, threads,
        q.data_ptr(), k.data_ptr(), v.data_ptr(),
        None if mask is None else mask.data_ptr(), out.data_ptr(),
        (ctypes.c_int64 * 16)(*strides),
    )  # fmt: skip
    return out.transpose(1, 2)


def best_extensions(lprobs: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor] | None:
    """The best k of each sentence's beams x V candidates, lprobs (N * beams, V) plus each
    row's score, scores (N, beams): their values (N, k), best first, and positions in
    [0, beams * V) (N, k), the lower first among equal values (where torch's topk orders
    ties as it likes); otherwise torch's
    (lprobs.view(N, beams, V) + scores[..., None]).view(N, -1).topk(k). Neither may hold
    NaN (log-probabilities, -inf where banned): a NaN met once k are kept is passed over,
    where topk would rank it first. None where the kernel does not take these inputs or
    could not be built."""
    lib, threads = _ready()
    if lib is None:
        return None
    (n, beams), (rows, vocab) = scores.shape, lprobs.shape
    f32 = torch.float32
    if not (
        lprobs.dtype == scores.dtype == f32
        and lprobs.device.type == scores.device.type == "cpu"
        and lprobs.is_contiguous()
        and scores.is_contiguous()
        and rows == n * beams
        and 0 < k <= beams * vocab
    ):
        return None
    top = lprobs.new_empty(n, k)
    index = torch.empty(n, k, dtype=torch.long)
    lib.best_extensions(
        n, beams, vocab, k, threads,
        lprobs.data_ptr(), scores.data_ptr(), top.data_ptr(), index.data_ptr(),
    )  # fmt: skip
    return top, index


def add_norm(x: Tensor, y: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor | None:
    """F.layer_norm(x + y, (D,), weight, bias, eps) for x, y (..., D), written over y (the
    caller's to overwrite); None where the kernel does not take these inputs (anything but
    contiguous fp32 on a CPU without gradients, D a multiple of 16) or could not be built."""
    lib, threads = _ready()
    d, tensors = x.shape[-1], (x, y, weight, bias)
    if lib is None or x.shape != y.shape or d % TILE or not weight.shape == bias.shape == (d,):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors):
        return None
    lib.add_norm(
        x.numel() // d, d, threads, x.data_ptr(), y.data_ptr(), weight.data_ptr(),
        bias.data_ptr(), eps, y.data_ptr(),
    )  # fmt: skip
    return y


def log_softmax_(x: Tensor) -> Tensor | None:
    """torch.log_softmax(x, -1) written over x (..., V), contiguous fp32 on a CPU without
    gradients, no NaN (a step's logits); torch's to ~1e-6; None where the kernel does not
    take x or could not be built."""
    lib, threads = _ready()
    if lib is None or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():
        return None
    if x.requires_grad and torch.is_grad_enabled():
        return None
    v = x.shape[-1]
    lib.log_softmax(x.numel() // v, v, threads, x.data_ptr())
    return x


def linear(x: Tensor, panels: Tensor, bias: Tensor | None, n: int) -> Tensor | None:
    """x (..., K) w^T + bias for a weight w (n, K) packed as tile_keys(w), (ceil(n / 16), K,
    16), on a CPU without gradients (kernels.Linear.panels sees to both): F.linear's to
    rounding; None where the kernel does not take these inputs (x not contiguous fp32, a
    bias not contiguous) or could not be built. Few checks: it runs 13 times a step."""
    lib, threads = _ready()
    *rows, k = x.shape
    if lib is None or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    if panels.shape != (-(-n // TILE), k, TILE) or (bias is not None and not bias.is_contiguous()):
        return None
    y = x.new_empty((*rows, n))
    b = None if bias is None else bias.data_ptr()
    lib.linear(
        y.numel() // n, n, k, threads, x.data_ptr(), k, panels.data_ptr(), b, y.data_ptr(), n
    )
    return y


def reads_tiles(t: Tensor) -> bool:
    """Whether `attend` can read keys like `t` (..., d_k) in tiles: fp32 on a CPU, and the
    kernels run (`available`); kernels.reads_tiles adds where they are called."""
    fits = t.dtype == torch.float32 and t.size(-1) <= MAX_HEAD and t.device.type == "cpu"
    return fits and available()


def available() -> bool:
    """Whether the kernels run: built, and for torch's threads (see `_ready`)."""
    return _ready()[0] is not None


def tile_keys(k: Tensor) -> Tensor:
    """Keys k (..., L, d_k) -> (..., ceil(L / 16), d_k, 16): slot l in tile l // 16, lane
    l % 16 (the lanes past L zero). A weight (out, in) so becomes `linear`'s panels."""
    n = k.size(-2)
    tiles = -(-n // TILE)
    rows = F.pad(k, (0, 0, 0, tiles * TILE - n)) if n % TILE else k
    return rows.unflatten(-2, (tiles, TILE)).transpose(-2, -1).contiguous()


def put_slots(dest: Tensor, rows: Tensor, start: int) -> None:
    """New keys or values, rows (B, h, n, d_k), into slots start .. start + n - 1 of a
    cache's dest: values (B, h, slots, d_k), or keys in tiles (B, h, tiles, d_k, 16) (the
    library is built: `reads_tiles` said so)."""
    room = dest.size(2) * TILE if dest.dim() == 5 else dest.size(2)
    assert rows.stride(3) == 1 and start + rows.size(2) <= room
    _move_slots(dest, rows.size(2), rows, rows.stride()[:3], start, None)


def keep_slots(dest: Tensor, slots: Tensor) -> None:
    """Slot slots[b, j] of each row of dest (as `put_slots`'s) into slot j, in place; where
    slots[b, j] < j (slots that no row sees, kv_cache) slot j gets some slot of its row."""
    slots = slots.contiguous()
    _move_slots(dest, slots.size(1), None, (0, 0, 0), 0, slots)


def _move_slots(
    dest: Tensor,
    n: int,
    rows: Tensor | None,
    row_strides: tuple[int, ...],
    start: int,
    slots: Tensor | None,
) -> None:
    (b, h, _, d), tiled, (lib, threads) = dest.shape[:4], dest.dim() == 5, _ready()
    inner = (d * TILE, TILE, 1) if tiled else (d, 1)
    assert dest.stride()[2:] == inner, "a row's slots contiguous"
    lib.move_slots(
        b, h, n, d, tiled, threads, dest.data_ptr(), (ctypes.c_int64 * 2)(*dest.stride()[:2]),
        None if rows is None else rows.data_ptr(), (ctypes.c_int64 * 3)(*row_strides),
        start, None if slots is None else slots.data_ptr(),
    )  # fmt: skip


def untile_keys(k: Tensor, n: int) -> Tensor:
    """The first n keys of tiles k (..., tiles, d_k, 16) as rows (..., n, d_k), a copy."""
    return k.transpose(-2, -1).flatten(-3, -2)[..., :n, :]


def _ready() -> tuple[ctypes.CDLL | None, int]:
    """The library and torch's threads, or None where it is not built or, built without
    OpenMP, would run one thread where torch runs several."""
    lib, threads = library(), torch.get_num_threads()
    return (None if threads > 1 and not _parallel else lib), threads


def _takes(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    (qs, ks, vs), f32 = (q.shape, k.shape, v.shape), torch.float32
    if len(qs) != 4 or len(vs) != 4 or qs[:2] != ks[:2] or ks[:2] != vs[:2]:
        return False
    (m, d), (n, d_v) = qs[2:], vs[2:]
    if not (d == d_v <= MAX_HEAD and m <= MAX_QUERIES and 0 < n <= MAX_KEYS):
        return False
    if not (q.dtype == k.dtype == v.dtype == f32 and q.is_cpu and k.is_cpu and v.is_cpu):
        return False
    if len(ks) == 5:  # tiles (..., >= ceil(L / 16), d_k, 16), each contiguous
        if ks[3:] != (d, TILE) or ks[2] * TILE < n or k.stride()[3:] != (TILE, 1):
            return False
    elif ks != vs:
        return False
    if d > 1 and not (q.stride(3) == k.stride(-1) == v.stride(3) == 1):  # rows contiguous
        return False
    return mask is None or (
        mask.dtype in (f32, torch.bool)
        and mask.is_cpu
        and mask.dim() <= 4
        and mask.shape[-1] == n  # not broadcast along the keys
        and (mask.dtype == torch.bool or n == 1 or mask.stride(-1) == 1)  # bool: converted
    )


def library() -> ctypes.CDLL | None:
    """The selected build (`select`), building it on the first call; None for "torch" or if
    it cannot be built (one warning: the slow path, and how to get the fast one)."""
    global _library, _loaded, _parallel, _tried
    if not _tried:
        _tried = True
        name = _wanted or runnable()[0]
        if name != "torch" and name not in _built:
            _built[name] = None, False
            try:
                _built[name] = _load(name)
            except (OSError, subprocess.SubprocessError) as e:
                log.warning(
                    "decoding on this CPU: torch's ops, the slow path (no C kernels: %s); a C "
                    "compiler (gcc or clang; CC names another) builds them at first use",
                    e,
                )
        _library, _parallel = _built.get(name, (None, False))
        _loaded = "torch" if _library is None else name
    return _library


def describe_cpu() -> str:
    """One line for a report: the CPU's model (family and model numbers tell AMD's Zen
    generations apart), the instruction sets that choose a build here and torch's."""
    info = dict(tuple(part.strip() for part in line.split(":", 1)) for line in _cpuinfo())
    name = info.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in info:
        name += f", family {info['cpu family']} model {info.get('model', '?')}"
    flags, wanted = cpu_flags(), ("avx512f", "avx512_bf16", "amx_bf16", "avx2", "fma")
    has = " ".join(f for f in wanted if _flag(f) in flags) or "none of them"
    lacks = " ".join(f for f in wanted if _flag(f) not in flags)
    sets = f"; {has}" + (f", no {lacks}" if lacks else "") if _X86 else ""
    capability = torch.backends.cpu.get_cpu_capability()
    return f"CPU: {name} ({platform.machine()}){sets}; torch's CPU kernels: {capability}"


def describe() -> str:
    """One line for a log: which build runs a decoding step's C kernels here, if any."""
    lib = library()
    if lib is None:
        why = "not selected" if _wanted == "torch" else "could not be built: the slow path"
        return f"decoding on this CPU: torch's ops (the C kernels {why})"
    threads = "OpenMP threads" if _parallel else "one thread only"
    return (
        f"decoding on this CPU: C kernels, {_loaded} build ({lib.lanes()} floats a vector; "
        f"transformer/nn/cpu_decoding.c, {threads})"
    )


def _load(name: str) -> tuple[ctypes.CDLL, bool]:
    """The library of build `name` with OpenMP, else without: a compiler may have no OpenMP, or
    one whose runtime is not linked in (Clang's libomp: the load then fails on its
    symbols)."""
    cc = os.environ.get("CC", "cc")
    for openmp in (["-fopenmp"], []):
        try:
            lib = ctypes.CDLL(str(_build(cc, FLAGS + BUILD_FLAGS[name] + openmp)))
        except subprocess.CalledProcessError as e:
            lines = (e.stderr or "").splitlines()
            error = next((line for line in lines if "error" in line), f"exit {e.returncode}")
            continue
        except OSError as e:  # not loadable
            error = str(e)
            continue
        lib.build.restype, lib.lanes.restype = ctypes.c_char_p, ctypes.c_int
        if (made := lib.build().decode()) != name:  # the flags did not take
            raise OSError(f"{cc} built the {made} loops for the {name} build")
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.attend.argtypes = [i64] * 5 + [ctypes.c_int, ctypes.c_float, ctypes.c_int] + [ptr] * 6
        lib.best_extensions.argtypes = [i64] * 4 + [ctypes.c_int] + [ptr] * 4
        lib.move_slots.argtypes = [i64] * 4 + [ctypes.c_int] * 2 + [ptr] * 4 + [i64, ptr]
        f32 = ctypes.c_float
        lib.add_norm.argtypes = [i64, i64, ctypes.c_int] + [ptr] * 4 + [f32, ptr]
        lib.linear.argtypes = [i64] * 3 + [ctypes.c_int, ptr, i64] + [ptr] * 3 + [i64]
        lib.log_softmax.argtypes = [i64, i64, ctypes.c_int, ptr]
        kernels = (lib.attend, lib.best_extensions, lib.move_slots, lib.add_norm, lib.linear)
        for f in (*kernels, lib.log_softmax):
            f.restype = None
        return lib, bool(openmp)
    raise OSError(f"{cc} failed: {error.strip()}")


def _build(cc: str, flags: list[str]) -> Path:
    """The shared library for these flags, compiled unless it is in the cache already."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True)
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.stdout.encode(), " ".join(flags).encode()):
        key.update(part)
    key.update(_cpu().encode())
    path = _cache_dir() / f"cpu_decoding-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".building-", suffix=".so")
    os.close(fd)
    try:
        cmd = [cc, *flags, str(SOURCE), "-o", tmp, "-lm"]
        subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cpuinfo() -> list[str]:
    """The first CPU's lines of /proc/cpuinfo (none where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return []


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and features."""
    lines = [line for line in _cpuinfo() if line.startswith(("model name", "flags"))]
    return "\n".join([platform.machine(), platform.processor(), *lines])


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "transformer-mt"
