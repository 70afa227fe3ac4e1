/*
 * emu_host_begin.h / emu_host_end.h: around a second #include of a .cu, in
 * a namespace of the emulation's own, they compile its kernels as host code
 * for emu_exec.h's executor:
 *
 *   #include "emu_exec.h"
 *   #include "emu_host_begin.h"
 *   namespace emu_dev {
 *   #include "optim.cu"
 *   }
 *   #include "emu_host_end.h"
 *
 * __global__ and __device__ read as __host__, __shared__ as static in
 * section emu_shared (poisoned before each block), __launch_bounds__ and
 * __grid_constant__ as nothing, the built-in indices, __syncthreads and
 * __shfl_xor_sync as the executor's. The .cu's include-guarded headers are
 * not read again: the host copy uses their first (host) compilation. Whatever else the copy
 * defines that the first one has defined at global scope with C linkage
 * (extern "C" entry points) the emulation renames around these headers.
 * No include guard: each use is a pair.
 */
#pragma push_macro("__global__")
#pragma push_macro("__device__")
#pragma push_macro("__shared__")
#pragma push_macro("__launch_bounds__")
#pragma push_macro("__grid_constant__")
#undef __global__
#undef __device__
#undef __shared__
#undef __launch_bounds__
#undef __grid_constant__
#define __global__ __host__
#define __device__ __host__
#define __shared__ static __attribute__((section("emu_shared"), used))
#define __launch_bounds__(...)
#define __grid_constant__
#define __syncthreads emu_syncthreads
#define __shfl_xor_sync emu_shfl_xor_sync
#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim
