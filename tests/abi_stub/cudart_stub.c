/* A stand-in for libcudart.so.13 that records kernel launches instead of running them.
 *
 * tests/test_abi.py loads compiled kernel modules against it on a machine without a GPU and
 * checks that the kernel parameters the DSL's host code builds from our packed argument
 * structs carry exactly the pointers, extents and strides of the tensors we passed.
 * (This caught a real bug: 32-bit symbolic strides with a header that declares int64_t.)
 */
#include <stdint.h>
#include <string.h>

typedef int cudaError_t;
typedef struct { unsigned x, y, z; } dim3;
typedef struct { dim3 gridDim; dim3 blockDim; size_t dynamicSmemBytes; void *stream; void *attrs; unsigned numAttrs; } cudaLaunchConfig_t;

static int g_nparams = 0;
static int g_sizes[64];
static unsigned char g_params[64][512];
static dim3 g_grid, g_block;
static void *g_stream;
static int g_launches = 0;

void stub_set_param_sizes(int n, const int *sizes) { g_nparams = n; memcpy(g_sizes, sizes, n * sizeof(int)); }
int stub_launches(void) { return g_launches; }
void stub_launch_config(unsigned *grid, unsigned *block, void **stream) {
  grid[0] = g_grid.x; grid[1] = g_grid.y; grid[2] = g_grid.z;
  block[0] = g_block.x; block[1] = g_block.y; block[2] = g_block.z;
  *stream = g_stream;
}
const unsigned char *stub_param(int i) { return g_params[i]; }

cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *c, const void *f, void **args) {
  g_grid = c->gridDim; g_block = c->blockDim; g_stream = c->stream; g_launches++;
  for (int i = 0; i < g_nparams; i++) memcpy(g_params[i], args[i], g_sizes[i]);
  return 0;
}
cudaError_t cudaLibraryLoadData(void **lib, const void *code, void *a, void *b, unsigned n, void *c, void *d, unsigned m) { *lib = (void *)0x1; return 0; }
cudaError_t cudaLibraryGetKernel(void **k, void *lib, const char *name) { *k = (void *)0x2; return 0; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return 0; }
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return 0; }
cudaError_t cudaDeviceGetAttribute(int *v, int a, int d) { *v = 0; return 0; }
cudaError_t cudaDriverGetVersion(int *v) { *v = 13090; return 0; }
/* Driver entry points the DSL runtime asks for, by name; anything else succeeds doing nothing. */
static int fake_cuKernelGetAttribute(int *v, int a, void *k, int d) { *v = 0; return 0; }
static int fake_cuDriverGetVersion(int *v) { *v = 13090; return 0; }
static int fake_cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return 0; }
static int fake_success(void) { return 0; }
cudaError_t cudaGetDriverEntryPointByVersion(const char *sym, void **fn, unsigned ver, unsigned long long flags, int *status) {
  if (!strcmp(sym, "cuKernelGetAttribute")) *fn = (void *)fake_cuKernelGetAttribute;
  else if (!strcmp(sym, "cuDriverGetVersion")) *fn = (void *)fake_cuDriverGetVersion;
  else if (!strcmp(sym, "cuDeviceGet")) *fn = (void *)fake_cuDeviceGet;
  else *fn = (void *)fake_success;
  if (status) *status = 0;
  return 0;
}
const char *cudaGetErrorString(int e) { return "stub error"; }
const char *cudaGetErrorName(int e) { return "stubError"; }

/* Everything else the DSL runtime links against: succeed and do nothing. */
#define Z(name) cudaError_t name(void) { return 0; }
Z(cudaFuncSetAttribute) Z(cudaKernelSetAttributeForDevice) Z(cudaDeviceSynchronize) Z(cudaGetLastError)
Z(cudaEventCreate) Z(cudaEventDestroy) Z(cudaEventElapsedTime) Z(cudaEventRecord) Z(cudaFree) Z(cudaFreeAsync)
Z(cudaFreeHost) Z(cudaGraphDestroy) Z(cudaGraphExecDestroy) Z(cudaGraphInstantiate) Z(cudaGraphLaunch)
Z(cudaLibraryGetGlobal) Z(cudaLibraryGetKernelCount) Z(cudaLibraryGetManaged) Z(cudaLibraryGetUnifiedFunction)
Z(cudaLibraryLoadFromFile) Z(cudaLibraryUnload) Z(cudaMalloc) Z(cudaMallocAsync) Z(cudaMallocHost)
Z(cudaMallocManaged) Z(cudaMemcpy) Z(cudaMemcpyAsync) Z(cudaMemset) Z(cudaMemsetAsync)
Z(cudaOccupancyMaxActiveBlocksPerMultiprocessor) Z(cudaProfilerStart) Z(cudaProfilerStop) Z(cudaSetDevice)
Z(cudaStreamAddCallback) Z(cudaStreamBeginCapture) Z(cudaStreamCreate) Z(cudaStreamDestroy)
Z(cudaStreamEndCapture) Z(cudaStreamSynchronize) Z(cudaStreamWaitEvent)
