"""CUDA code generation: lowering of µGraphs to kernels, emission of `.cu`/`.h`,
NVRTC compilation, the GPU runner and the benchmark (DESIGN.md §5, §7)."""
