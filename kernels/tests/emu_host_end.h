/* emu_host_end.h: the end of what emu_host_begin.h began (see there). */
#undef gridDim
#undef blockDim
#undef blockIdx
#undef threadIdx
#undef __shfl_xor_sync
#undef __syncthreads
#pragma pop_macro("__grid_constant__")
#pragma pop_macro("__launch_bounds__")
#pragma pop_macro("__shared__")
#pragma pop_macro("__device__")
#pragma pop_macro("__global__")
