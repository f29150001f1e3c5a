// The ceiling of the portable prefill (kernels/prefill_mma.py) on Hopper: how many bf16 FLOPs per
// second mma.sync.m16n8k16 (fp32 accumulate) gives on its own, against wgmma m64n128k16 (both
// operands in shared memory) on the same GPU.  mma.sync: each warp runs CHAINS independent
// accumulator chains on register operands (no loads, enough to hide latency), 8 / 16 warps per
// SM.  wgmma: one warpgroup per CTA, back-to-back batches of 8 on one accumulator, 1-2 CTAs per SM.
// All kernels run on every SM for ~0.1 s; TFLOP/s from CUDA events (clock drift included).
// Build: nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 mma_sync_peak.cu -o mma_sync_peak
// Run:   ./mma_sync_peak
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); return 1; } } while (0)

constexpr int CHAINS = 8, ITERS = 4096;

__global__ void mma_sync_loop(float* sink, uint32_t seed) {
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3c003c00u ^ (seed * (threadIdx.x + i));
  for (int i = 0; i < 2; ++i) b[i] = 0x3c003c00u ^ (seed * (threadIdx.x + 7 * i));
  float c[CHAINS][4] = {};
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int k = 0; k < CHAINS; ++k) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};"
          : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float s = 0.f;
  for (int k = 0; k < CHAINS; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (s == 12345.f) sink[threadIdx.x] = s;
}

// wgmma m64n128k16, A and B in shared memory (no swizzle, K-major; the values do not matter)
__global__ void wgmma_loop(float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < 64 * 16 + 128 * 16; i += blockDim.x) ((uint16_t*)smem)[i] = 0x3c00;
  __syncthreads();
  uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  auto desc = [](uint32_t addr) -> uint64_t {  // no swizzle: LBO 128 B, SBO 256 B
    return ((uint64_t)((addr & 0x3ffff) >> 4)) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
  };
  uint64_t da = desc(base), db = desc(base + 64 * 16 * 2);
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  for (int it = 0; it < ITERS / 8; ++it) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      asm volatile(
          "{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
          "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
          "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,"
          "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0; }"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
            "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
            "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
            "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
            "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
            "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
            "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
          : "l"(da), "l"(db));
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  float s = 0.f;
  for (int i = 0; i < 64; ++i) s += d[i];
  if (s == 12345.f) sink[threadIdx.x] = s;
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* sink;
  CK(cudaMalloc(&sink, 4096 * sizeof(float)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int reps = 20;
  for (int warps : {4, 8, 16}) {
    mma_sync_loop<<<sms, 32 * warps>>>(sink, 3);
    CK(cudaEventRecord(e0));
    for (int r = 0; r < reps; ++r) mma_sync_loop<<<sms, 32 * warps>>>(sink, 3 + r);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    double flops = 2.0 * 16 * 8 * 16 * CHAINS * (double)ITERS * warps * sms * reps;
    printf("mma.sync m16n8k16 bf16, %2d warps/SM: %7.1f TFLOP/s\n", warps, flops / (ms * 1e-3) / 1e12);
  }
  int smem = (64 * 16 + 128 * 16) * 2;
  for (int ctas : {1, 2}) {
    wgmma_loop<<<sms * ctas, 128, smem>>>(sink);
    CK(cudaEventRecord(e0));
    for (int r = 0; r < reps; ++r) wgmma_loop<<<sms * ctas, 128, smem>>>(sink);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    double flops = 2.0 * 64 * 128 * 16 * (double)(ITERS / 8 * 8) * sms * ctas * reps;
    printf("wgmma m64n128k16 bf16 (SS), %d warpgroup(s)/SM: %7.1f TFLOP/s\n", ctas, flops / (ms * 1e-3) / 1e12);
  }
  CK(cudaGetLastError());
  return 0;
}
