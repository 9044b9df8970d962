"""The GPU runner: executes a lowered program's cubin through the CUDA driver API
(cuda-python), with the same launch sequence as the generated host launcher.

- :class:`Device` owns a context and a stream; :meth:`Device.load` loads a cubin;
- :class:`Loaded` allocates inputs, outputs and workspace, copies, launches,
  poisons outputs with NaN, reads results back, and times calls as CUDA-graph
  replays (DESIGN.md §7).
"""

from __future__ import annotations

import ctypes
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mirage_cli.codegen.plan import Copy, Kernel, Launch, Program, TensorMapSpec
from mirage_cli.diagnostics import MirageError
from mirage_cli.dtypes import round_to
from mirage_cli.ir import DType, TensorType


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError:
            raise MirageError("the CUDA driver bindings are not installed (pip install "
                              "'mirage-cli[cuda12]' or '[cuda13]')") from None
    return driver


def gpu_available() -> bool:
    """Whether a CUDA device can be opened (used to skip GPU tests)."""
    try:
        drv = _driver()
        (err,) = drv.cuInit(0)
        if int(err) != 0:
            return False
        err, n = drv.cuDeviceGetCount()
        return int(err) == 0 and n > 0
    except Exception:  # noqa: BLE001 - any failure means: no usable GPU here
        return False


def check(res: Any, what: str) -> Any:
    """Unpack a driver call's (err, value...) tuple, raising on error."""
    drv = _driver()
    if isinstance(res, tuple):
        err, rest = res[0], res[1:]
    else:
        err, rest = res, ()
    if int(err) != 0:
        _, name = drv.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


# Faults after which the process's CUDA state is unusable: every later call fails with the
# same error, and no context reset clears it (mirage_cli.search.gpuproc).
STICKY_ERRORS = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_MISALIGNED_ADDRESS",
                 "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
                 "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_INVALID_PC",
                 "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_ASSERT",
                 "CUDA_ERROR_LAUNCH_TIMEOUT")


def is_sticky(e: BaseException) -> bool:
    """Whether ``e`` (from :func:`check`) reports a fault that left the process unusable."""
    return isinstance(e, RuntimeError) and any(code in str(e) for code in STICKY_ERRORS)


NAN_BITS = {DType.F16: 0x7E00, DType.BF16: 0x7FC0, DType.F32: 0x7FC00000}


def to_device_bytes(t: TensorType, x: np.ndarray) -> np.ndarray:
    """Host array in the device layout of ``t`` (f16 / bf16 bits / f32)."""
    x32 = round_to(t.dtype, np.asarray(x, dtype=np.float32))
    if t.dtype is DType.F16:
        return np.ascontiguousarray(x32.astype(np.float16))
    if t.dtype is DType.BF16:
        return np.ascontiguousarray((x32.view(np.uint32) >> 16).astype(np.uint16))
    return np.ascontiguousarray(x32)


def from_device_bytes(t: TensorType, raw: np.ndarray) -> np.ndarray:
    if t.dtype is DType.F16:
        return raw.view(np.float16).astype(np.float32).reshape(t.shape)
    if t.dtype is DType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
    return raw.view(np.float32).reshape(t.shape).copy()


class Device:
    def __init__(self, ordinal: int = 0) -> None:
        self.drv = drv = _driver()
        try:
            check(drv.cuInit(0), "cuInit")
        except Exception as e:  # noqa: BLE001 - no driver library or no device
            raise MirageError(f"no usable CUDA GPU here ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else e})") from None
        n = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < n:
            raise MirageError(f"--gpu {ordinal}: no such device ({n} present)")
        self.dev = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = check(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        check(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.stream = check(drv.cuStreamCreate(1), "cuStreamCreate")  # non-blocking
        name = check(drv.cuDeviceGetName(256, self.dev), "cuDeviceGetName")
        self.name = name.split(b"\x00")[0].decode()
        attr = drv.CUdevice_attribute
        self.cc = (check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                   self.dev), "attr"),
                   check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                                   self.dev), "attr"))
        self.l2_bytes = check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
                                                       self.dev), "attr")

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def alloc(self, nbytes: int) -> int:
        return int(check(self.drv.cuMemAlloc(max(nbytes, 16)), "cuMemAlloc"))

    def free(self, ptr: int) -> None:
        check(self.drv.cuMemFree(ptr), "cuMemFree")

    def upload(self, ptr: int, host: np.ndarray) -> None:
        # On the device's own stream, then waited for: kernels run on a non-blocking
        # stream, which is not ordered after the legacy stream's copies, and a
        # synchronous copy from pageable memory may return before its DMA has landed
        # (a kernel then read stale inputs under load: wrong results in 2 of 126 GPU
        # tests run 6 at a time on one GPU).
        host = np.ascontiguousarray(host)
        check(self.drv.cuMemcpyHtoDAsync(ptr, host.ctypes.data, host.nbytes, self.stream),
              "cuMemcpyHtoDAsync")
        self.sync()

    def download(self, ptr: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        self.sync()
        check(self.drv.cuMemcpyDtoH(out.ctypes.data, ptr, nbytes), "cuMemcpyDtoH")
        return out

    def poison(self, ptr: int, t: TensorType) -> None:
        bits = NAN_BITS[t.dtype]
        if t.dtype is DType.F32:
            check(self.drv.cuMemsetD32Async(ptr, bits, t.numel, self.stream), "cuMemsetD32")
        else:
            check(self.drv.cuMemsetD16Async(ptr, bits, t.numel, self.stream), "cuMemsetD16")

    def sync(self) -> None:
        check(self.drv.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def load(self, prog: Program, cubin: bytes) -> Loaded:
        return Loaded(self, prog, cubin)

    def time_graph(self, record: Any, calls: int, replays: int = 30) -> float:
        """Median µs per call: ``record(i)`` enqueues call ``i`` on the stream;
        ``calls`` of them are captured in one CUDA graph, replayed ``replays`` times."""
        drv = self.drv
        check(drv.cuStreamBeginCapture(self.stream,
                                       drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")
        for i in range(calls):
            record(i)
        graph = check(drv.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        exe = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        start = check(drv.cuEventCreate(0), "cuEventCreate")
        end = check(drv.cuEventCreate(0), "cuEventCreate")
        try:
            for _ in range(3):
                check(drv.cuGraphLaunch(exe, self.stream), "cuGraphLaunch")
            self.sync()
            times = []
            for _ in range(replays):
                check(drv.cuEventRecord(start, self.stream), "cuEventRecord")
                check(drv.cuGraphLaunch(exe, self.stream), "cuGraphLaunch")
                check(drv.cuEventRecord(end, self.stream), "cuEventRecord")
                check(drv.cuEventSynchronize(end), "cuEventSynchronize")
                ms = check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime")
                times.append(ms * 1000.0 / calls)
            return statistics.median(times)
        finally:
            drv.cuEventDestroy(start)
            drv.cuEventDestroy(end)
            drv.cuGraphExecDestroy(exe)
            drv.cuGraphDestroy(graph)


def out_key(name: str) -> str:
    return "\0out:" + name


@dataclass
class Buffers:
    ptrs: dict[str, int]
    workspace: int


class Loaded:
    """A program's module on a device."""

    def __init__(self, device: Device, prog: Program, cubin: bytes) -> None:
        self.d = device
        self.prog = prog
        drv = device.drv
        self._cubin = cubin  # keep the image alive while the module is loaded
        self._maps: dict[tuple[int, TensorMapSpec], Any] = {}  # tensor maps by address
        self.module = check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.funcs: dict[str, Any] = {}
        for k in prog.kernels:
            f = check(drv.cuModuleGetFunction(self.module, k.name.encode()), "cuModuleGetFunction")
            if k.smem_bytes > 48 * 1024:
                check(drv.cuFuncSetAttribute(
                    f, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    k.smem_bytes), "cuFuncSetAttribute")
            self.funcs[k.name] = f

    def alloc(self) -> Buffers:
        """Device memory for inputs (keyed by name), outputs (keyed ``out_key(name)``:
        an output may also be an input) and the workspace."""
        ptrs = {b.name: self.d.alloc(b.type.nbytes) for b in self.prog.inputs}
        ptrs.update({out_key(b.name): self.d.alloc(b.type.nbytes) for b in self.prog.outputs})
        return Buffers(ptrs, self.d.alloc(self.prog.workspace_bytes))

    def pointer(self, bufs: Buffers, name: str) -> int:
        """Where a kernel reads or writes device tensor ``name``."""
        name = self.prog.storage(name)
        if name in bufs.ptrs:  # an input (kernels never write inputs)
            return bufs.ptrs[name]
        if out_key(name) in bufs.ptrs:
            return bufs.ptrs[out_key(name)]
        return bufs.workspace + self.prog.buffer(name).index

    def free(self, bufs: Buffers) -> None:
        for p in bufs.ptrs.values():
            self.d.free(p)
        self.d.free(bufs.workspace)

    def upload_inputs(self, bufs: Buffers, inputs: Mapping[str, np.ndarray]) -> None:
        for b in self.prog.inputs:
            self.d.upload(bufs.ptrs[b.name], to_device_bytes(b.type, inputs[b.name]))

    def enqueue(self, bufs: Buffers, steps: tuple[Launch | Copy, ...] | None = None) -> None:
        """Launch every step (or only ``steps``, a kernel timed alone) on the device's
        stream (asynchronous)."""
        drv = self.d.drv
        for s in self.prog.steps if steps is None else steps:
            if isinstance(s, Copy):
                check(drv.cuMemcpyDtoDAsync(bufs.ptrs[out_key(s.dst)], bufs.ptrs[s.src], s.nbytes,
                                            self.d.stream), "cuMemcpyDtoDAsync")
                continue
            assert isinstance(s, Launch)
            k = self.prog.kernel(s.kernel)
            cells: list[ctypes.c_void_p] = []
            addrs: list[int] = []
            for p in k.params:
                if p.arg == "$scratch":
                    cells.append(ctypes.c_void_p(bufs.workspace + s.scratch_offset))
                elif p.tmap is not None:  # by value: the map itself is the argument
                    addrs.append(self._tensor_map(self.pointer(bufs, p.arg), p.tmap).getPtr())
                    continue
                else:
                    cells.append(ctypes.c_void_p(self.pointer(bufs, p.arg)))
                addrs.append(ctypes.addressof(cells[-1]))
            argv = (ctypes.c_void_p * len(addrs))(*addrs)
            check(drv.cuLaunchKernelEx(self._config(k), self.funcs[k.name],
                                       ctypes.addressof(argv), 0), "cuLaunchKernelEx")

    def _tensor_map(self, ptr: int, spec: TensorMapSpec) -> Any:
        """The ``CUtensorMap`` of ``spec`` over the tensor at ``ptr`` (encoded once per
        address, as the generated launcher encodes it on every call)."""
        hit = self._maps.get((ptr, spec))
        if hit is None:
            drv = self.d.drv
            u64, u32 = drv.cuuint64_t, drv.cuuint32_t
            hit = check(drv.cuTensorMapEncodeTiled(
                getattr(drv.CUtensorMapDataType, spec.dtype_enum), len(spec.dims), ptr,
                [u64(d) for d in spec.dims], [u64(x) for x in spec.strides],
                [u32(b) for b in spec.box], [u32(1)] * len(spec.dims),
                drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                getattr(drv.CUtensorMapSwizzle, spec.swizzle_enum),
                drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                "cuTensorMapEncodeTiled")
            self._maps[(ptr, spec)] = hit
        return hit

    def _config(self, k: Kernel) -> Any:
        """The launch of ``k`` as the generated entry point makes it: on compute
        capability 9.0 and later with programmatic stream serialisation (the kernel may
        start while the one before it drains; its first act waits for that one)."""
        drv = self.d.drv
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = k.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = k.threads, 1, 1
        cfg.sharedMemBytes = k.smem_bytes
        cfg.hStream = self.d.stream
        if self.d.cc[0] >= 9:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
        return cfg

    def run(self, inputs: Mapping[str, np.ndarray], bufs: Buffers | None = None
            ) -> dict[str, np.ndarray]:
        """Upload, poison outputs, launch once, read back every output as float32."""
        own = bufs is None
        bufs = bufs or self.alloc()
        try:
            self.upload_inputs(bufs, inputs)
            for b in self.prog.outputs:
                self.d.poison(bufs.ptrs[out_key(b.name)], b.type)
            self.enqueue(bufs)
            self.d.sync()
            return {b.name: from_device_bytes(b.type, self.d.download(
                bufs.ptrs[out_key(b.name)], b.type.nbytes)) for b in self.prog.outputs}
        finally:
            if own:
                self.free(bufs)

    def unload(self) -> None:
        check(self.d.drv.cuModuleUnload(self.module), "cuModuleUnload")
