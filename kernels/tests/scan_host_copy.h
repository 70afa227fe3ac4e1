/*
 * scan_host_copy.h: kernels/scan.cu a second time, as host code in namespace
 * emu_dev (emu_host_begin.h around it), for the emulations that run its
 * kernels themselves, each thread a fiber of emu_exec.h: csr_emulation.cu
 * (rp_csr_kernel) and scan_emulation.cu (the scan kernels, through their
 * device executor rp_scan_dev, whose barrier and shuffle
 * RP_SCAN_HOST_THREADS turns on). Include it after the first #include of
 * scan.cu (with the runtime's renames), once.
 *
 * The copy's extern "C" entry points are renamed (dead code), as are
 * rp_csr_check_run and rp_scan_rows (nvcc finds both copies ambiguous).
 * __shared__ reads as nothing: only the scan kernels' dynamic shared memory
 * has it, the extern array rp_scan_smem, which the copy reads through
 * emu_dev::emu_scan_smem, a pointer the emulation sets to a buffer of its
 * own (fenced, poisoned) before each block.
 */
#ifndef REPROP_SCAN_HOST_COPY_H
#define REPROP_SCAN_HOST_COPY_H

#include "emu_exec.h"
#include "emu_host_begin.h"
#undef __shared__
#define __shared__
#define RP_SCAN_HOST_THREADS
#define rp_scan_smem (*emu_scan_smem)
#define rp_cuda_scan_shared_bytes emu_dead_scan_shared_bytes
#define rp_cuda_shared_memory_per_block emu_dead_shared_memory_per_block
#define rp_cuda_scan emu_dead_scan
#define rp_cuda_csr_run emu_dead_csr_run
#define rp_csr_check_run emu_dead_csr_check_run
#define rp_scan_rows emu_host_scan_rows
#define rp_cuda_cusparse_built emu_dead_cusparse_built
#define rp_cuda_cusparse_free emu_dead_cusparse_free
#define rp_cuda_cusparse_create emu_dead_cusparse_create
#define rp_cuda_cusparse_run emu_dead_cusparse_run
namespace emu_dev {
float4 (*emu_scan_smem)[]; /* the running block's dynamic shared memory */
#include "scan.cu"
} // namespace emu_dev
#undef rp_cuda_cusparse_run
#undef rp_cuda_cusparse_create
#undef rp_cuda_cusparse_free
#undef rp_cuda_cusparse_built
#undef rp_scan_rows
#undef rp_csr_check_run
#undef rp_cuda_csr_run
#undef rp_cuda_scan
#undef rp_cuda_shared_memory_per_block
#undef rp_cuda_scan_shared_bytes
#undef rp_scan_smem
#undef RP_SCAN_HOST_THREADS
#include "emu_host_end.h"

#endif /* REPROP_SCAN_HOST_COPY_H */
