/*
 * emu_faults.h: the injected faults of the scan, CSR and FAD emulations,
 * whose launchers fail alike: a refused launch, an error cudaGetLastError
 * reports after a launch, no device. (optim_emulation.cu injects its own, per
 * launch kind.) Include after emu_runtime.h and reprop.h.
 */
#ifndef REPROP_EMU_FAULTS_H
#define REPROP_EMU_FAULTS_H

typedef enum { FAULT_NONE, FAULT_LAUNCH, FAULT_LAST_ERROR, FAULT_GET_DEVICE } emu_fault;

static struct {
    emu_fault fault;
    int at; /* the launch (0-based) the fault hits */
} g_fault;

static bool emu_get_device_fails(void) { return g_fault.fault == FAULT_GET_DEVICE; }

/* In the mock of the call's index-th launch: the error a refused launch
 * returns, else cudaSuccess (after setting what cudaGetLastError reports). */
static cudaError_t emu_injected_launch_error(int index)
{
    if (g_fault.fault == FAULT_LAUNCH && index == g_fault.at)
        return cudaErrorLaunchOutOfResources;
    if (g_fault.fault == FAULT_LAST_ERROR && index == g_fault.at)
        g_emu.pending = cudaErrorIllegalAddress; /* "launched", then reported */
    return cudaSuccess;
}

/* Each fault at each of the first `launches` launches of call(err), which
 * sets up its expectations and returns the launcher's status: the status
 * must be RP_ERUNTIME with `message` in err, the outcome emu_check_fault_outcome's.
 * `counter` is the emulation's count of the call's launches. A launcher that
 * runs on the current device as it finds it (gets_device false: it never
 * calls cudaGetDevice) is spared the failing cudaGetDevice. */
template <class Call>
static void emu_check_faults(int launches, int &counter, const char *message, Call call,
                             bool gets_device = true)
{
    const emu_fault faults[] = {FAULT_LAUNCH, FAULT_LAST_ERROR, FAULT_GET_DEVICE};
    for (emu_fault f : faults)
        for (int at = 0; at < launches && (gets_device || f != FAULT_GET_DEVICE); at++) {
            snprintf(g_context, sizeof g_context, "error: fault %d at launch %d", (int)f, at);
            rp_error err;
            g_fault.fault = f;
            g_fault.at = at;
            counter = 0;
            g_emu.pending = cudaSuccess;
            g_emu.current_device = 0;
            err.msg[0] = '\0';
            const int rc = call(err);
            CHECK(rc == RP_ERUNTIME && strstr(err.msg, message) != NULL, "status %d: %s", rc,
                  err.msg);
            emu_check_fault_outcome(f == FAULT_GET_DEVICE, at, counter);
            if (f == FAULT_GET_DEVICE)
                break;
        }
    g_fault.fault = FAULT_NONE;
}

#endif /* REPROP_EMU_FAULTS_H */
