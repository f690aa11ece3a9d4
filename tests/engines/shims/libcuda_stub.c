/* Test-harness stub of the CUDA driver library (libcuda.so.1), never product code.
 *
 * The PyPI build of mooncake-transfer-engine links libcuda.so.1 even when it only moves
 * host memory over TCP. On a machine without a GPU driver the suite builds this file with
 * gcc and puts it first on the Mooncake engines' LD_LIBRARY_PATH: every driver call answers
 * CUDA_ERROR_NO_DEVICE, so Mooncake treats every buffer as host memory. The symbol list is
 * what mooncake-transfer-engine 0.3.13's shared objects import (nm -D --undefined-only).
 */
#define CUDA_ERROR_NO_DEVICE 100

static const char no_device[] = "CUDA_ERROR_NO_DEVICE (stub libcuda: no GPU driver)";

int cuGetErrorName(int error, const char **name) {
    (void)error;
    if (name) *name = "CUDA_ERROR_NO_DEVICE";
    return 0;
}

int cuGetErrorString(int error, const char **text) {
    (void)error;
    if (text) *text = no_device;
    return 0;
}

#define NO_DEVICE(name) int name(void) { return CUDA_ERROR_NO_DEVICE; }
NO_DEVICE(cuInit)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemExportToShareableHandle)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemGetHandleForAddressRange)
NO_DEVICE(cuMemImportFromShareableHandle)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerSetAttribute)
