/*
 * emu_runtime.h: the CUDA runtime as the host emulations of the launchers
 * (optim_emulation.cu, scan_emulation.cu, csr_emulation.cu,
 * fad_emulation.cu) present it to the .cu under test.
 *
 * The launchers' runtime calls are renamed to host mocks (a <<<>>> launch
 * calls the runtime from code nvcc generates after preprocessing, out of a
 * rename's reach: fad_emulation.cu wraps those entry points at link time and
 * hands them to its launch mock). Those about
 * devices, streams and the last error behave the same for every launcher and
 * are defined here; the launch and attribute mocks are what each emulation
 * checks, so each defines its own (declared here, for the renames). Calls a
 * launcher makes beyond these (cudaGetDeviceCount, cudaGetErrorString) stay
 * the real static runtime's.
 *
 * Include this right before the .cu under test, with EMU_DEVICES defined (the
 * emulated devices, numbered from 0) and emu_get_device_fails() defined
 * somewhere in the file. The renames stay in force after the .cu: the tests
 * call the mocks by their own names and need none of the real ones renamed.
 */
#ifndef REPROP_EMU_RUNTIME_H
#define REPROP_EMU_RUNTIME_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "emu_check.h"

#ifndef EMU_DEVICES
#error "define EMU_DEVICES, the number of emulated devices, before including emu_runtime.h"
#endif

/* The emulated runtime: each case sets the current device and its call's
 * stream before calling the launcher, and checks them after. */
static struct {
    int current_device;
    cudaStream_t stream; /* the call's stream */
    int stream_device;   /* its device: current during every launch */
    bool capturing;      /* it is being captured into a CUDA graph */
    cudaError_t pending; /* what cudaGetLastError returns next */
    long get_device_calls;
} g_emu;

/* Stream handles of the emulated devices (never dereferenced). */
static cudaStream_t emu_stream(int dev) { return (cudaStream_t)(uintptr_t)(0x5000 + 0x100 * dev); }

/* Whether cudaGetDevice must fail now: each emulation injects its own faults. */
static bool emu_get_device_fails(void);

static cudaError_t mock_launch_kernel(const void *fn, dim3 grid, dim3 block, void **args,
                                      size_t smem, cudaStream_t stream);
static cudaError_t mock_device_get_attribute(int *value, cudaDeviceAttr attr, int dev);

static cudaError_t mock_get_device(int *dev)
{
    g_emu.get_device_calls++;
    if (emu_get_device_fails()) {
        g_emu.pending = cudaErrorNoDevice; /* the runtime records every failure */
        return cudaErrorNoDevice;
    }
    *dev = g_emu.current_device;
    return cudaSuccess;
}

/* The real runtime refuses cudaStreamGetDevice on a capturing stream, and
 * the refusal invalidates the capture: asking is a failure of the launcher. */
static cudaError_t mock_stream_get_device(cudaStream_t stream, int *dev)
{
    CHECK(!(g_emu.capturing && stream == g_emu.stream),
          "cudaStreamGetDevice on stream %p while it is captured", (void *)stream);
    for (int d = 0; d < EMU_DEVICES; d++) {
        if (stream == emu_stream(d)) {
            *dev = d;
            return cudaSuccess;
        }
    }
    CHECK(false, "cudaStreamGetDevice on stream %p, not an emulated one", (void *)stream);
    return cudaErrorInvalidResourceHandle;
}

static cudaError_t mock_stream_is_capturing(cudaStream_t stream, cudaStreamCaptureStatus *status)
{
    *status = g_emu.capturing && stream == g_emu.stream ? cudaStreamCaptureStatusActive
                                                        : cudaStreamCaptureStatusNone;
    return cudaSuccess;
}

static cudaError_t mock_set_device(int dev)
{
    CHECK(dev >= 0 && dev < EMU_DEVICES, "cudaSetDevice(%d)", dev);
    g_emu.current_device = dev;
    return cudaSuccess;
}

static cudaError_t mock_get_last_error(void)
{
    const cudaError_t e = g_emu.pending;
    g_emu.pending = cudaSuccess;
    return e;
}

/* For the launch mocks: kernels launch on the current device, so a launch
 * on the right stream with another device current would run elsewhere. */
static void emu_check_launch_site(dim3 grid, dim3 block, cudaStream_t stream)
{
    CHECK(stream == g_emu.stream, "launch on stream %p, the call's is %p", (void *)stream,
          (void *)g_emu.stream);
    CHECK(g_emu.current_device == g_emu.stream_device, "launch on device %d, the stream's is %d",
          g_emu.current_device, g_emu.stream_device);
    CHECK(grid.y == 1 && grid.z == 1 && block.y == 1 && block.z == 1, "grid or block not 1-D");
}

#define cudaLaunchKernel mock_launch_kernel
#define cudaGetDevice mock_get_device
#define cudaStreamGetDevice mock_stream_get_device
#define cudaStreamIsCapturing mock_stream_is_capturing
#define cudaSetDevice mock_set_device
#define cudaDeviceGetAttribute mock_device_get_attribute
#define cudaGetLastError mock_get_last_error

/* After a call that met an injected fault at launch `at`, having made
 * `launches`: a failed cudaGetDevice (no_device) launches nothing, a refused
 * or reported launch stops the call there; either way the caller's device
 * is back and no error is left pending. */
static void emu_check_fault_outcome(bool no_device, int at, int launches)
{
    if (no_device)
        CHECK(launches == 0, "%d launches", launches);
    else
        CHECK(launches == at + 1, "%d launches, fault at %d", launches, at);
    CHECK(g_emu.current_device == 0, "device %d not restored", g_emu.current_device);
    CHECK(g_emu.pending == cudaSuccess, "error left pending");
}

#endif /* REPROP_EMU_RUNTIME_H */
