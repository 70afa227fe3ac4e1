/*
 * rp_cuda.cuh: host-side pieces shared by the CUDA launchers: the CUDA error
 * convention and running a call on the device of the caller's stream.
 * Included by each .cu after reprop.h; its runtime calls go through the same
 * names the host emulations (kernels/tests/optim_emulation.cu and
 * scan_emulation.cu) replace.
 */
#ifndef REPROP_CUDA_CUH
#define REPROP_CUDA_CUH

#include <cuda_runtime.h>

#include "reprop.h"

/* RP_ERUNTIME with CUDA's text, the error cleared if it is not sticky. */
static int rp_cuda_error(cudaError_t e, const char *fn, rp_error *err)
{
    (void)cudaGetLastError();
    return rp_set_error(err, RP_ERUNTIME, "CUDA error in %s: %s", fn, cudaGetErrorString(e));
}

/* Makes the device of `stream` current for the lifetime of the guard
 * (kernels launch on the current device), restoring the caller's after.
 * A stream that names no device (NULL, legacy, per-thread), a driver too
 * old to say, or a stream being captured into a CUDA graph leaves the
 * current one, which the Python callers make the tensors'
 * (_tensors.on_device). A capturing stream cannot be asked: the runtime
 * refuses cudaStreamGetDevice on it (cudaErrorStreamCaptureUnsupported) and
 * the refusal invalidates the capture; cudaStreamIsCapturing is allowed. */
struct rp_device_guard {
    int dev = 0; /* the device the call runs on */
    int prev = -1;
    bool switched = false;

    cudaError_t enter(cudaStream_t stream)
    {
        cudaError_t e = cudaGetDevice(&dev);
        if (e != cudaSuccess)
            return e;
#if CUDART_VERSION >= 12080
        if (stream != NULL && stream != cudaStreamLegacy && stream != cudaStreamPerThread) {
            int sdev = dev;
            cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
            e = cudaStreamIsCapturing(stream, &capture);
            if (e != cudaSuccess)
                return e;
            if (capture != cudaStreamCaptureStatusNone)
                return cudaSuccess;
            e = cudaStreamGetDevice(stream, &sdev);
            if (e == cudaErrorCallRequiresNewerDriver) {
                /* a 12.8+ build on an older driver (minor-version
                 * compatibility) cannot ask: run on the current device, which
                 * the Python callers make the tensors' (_tensors.on_device) */
                (void)cudaGetLastError();
                return cudaSuccess;
            }
            if (e != cudaSuccess)
                return e;
            if (sdev != dev) {
                e = cudaSetDevice(sdev);
                if (e != cudaSuccess)
                    return e;
                prev = dev;
                switched = true;
                dev = sdev;
            }
        }
#else
        (void)stream;
#endif
        return cudaSuccess;
    }

    ~rp_device_guard()
    {
        if (switched)
            (void)cudaSetDevice(prev);
    }
};

#endif /* REPROP_CUDA_CUH */
