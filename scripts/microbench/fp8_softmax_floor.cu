// The fp8 attention kernel's softmax per 192-key block, alone: how many clocks a consumer warp
// needs for its 2 rows x 48 scores (one thread's share of a 64 x 192 S tile) -- row max (4
// partial maxima, 2 quad shuffles), x = s * scale - m * scale (FFMA), 2^x (MUFU.EX2, or for k of
// every 8 columns an FMA-pipe polynomial: floor by a round-down add, degree 3, exponent added as
// an integer), the row sum, and P packed to e4m3 (cvt.rn.satfinite.e4m3x2.f32, two per word).
// Run with 1 warp per scheduler (the ping-pong's ideal: one WG in softmax while the other's GEMMs
// run) and 2 (both consumer WGs in softmax at once).  Also the pipe question: does the e4m3
// conversion share the MUFU's pipe (ex2 alone vs ex2 + one cvt per two ex2)?
// Build: nvcc -O3 -arch=sm_90a -std=c++17 fp8_softmax_floor.cu -o fp8_softmax_floor
// Run:   ./fp8_softmax_floor
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); return 1; } } while (0)

constexpr int NCOL = 48, ROWS = 2, ITERS = 256;

__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float ex2_poly(float x) {
  float y;
  asm("{ .reg .f32 t, j, n, f, p; .reg .b32 e, q;\n"
      " max.f32 t, %1, 0fC2FE0000; add.rm.f32 j, t, 0f4B400000; sub.f32 n, j, 0f4B400000; sub.f32 f, t, n;\n"
      " fma.rn.f32 p, f, 0f3D9DD255, 0f3E691D67; fma.rn.f32 p, p, f, 0f3F31F315; fma.rn.f32 p, p, f, 0f3F800000;\n"
      " mov.b32 e, j; shl.b32 e, e, 23; mov.b32 q, p; add.s32 q, q, e; mov.b32 %0, q; }"
      : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  uint32_t w;
  asm("{ .reg .b16 l, h; cvt.rn.satfinite.e4m3x2.f32 l, %2, %1; cvt.rn.satfinite.e4m3x2.f32 h, %4, %3; mov.b32 %0, {l, h}; }"
      : "=r"(w) : "f"(a), "f"(b), "f"(c), "f"(d));
  return w;
}

template <int EMUL>
__global__ void softmax_tile(uint32_t* sink, long long* clk, float scale) {
  float s[ROWS][NCOL];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NCOL; ++c) s[r][c] = 0.001f * ((threadIdx.x * 7 + c * 13 + r) % 97);
  uint32_t acc = 0;
  float l[ROWS] = {0.f, 0.f};
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float m4[4] = {s[r][0], s[r][1], s[r][2], s[r][3]};
#pragma unroll
      for (int c = 4; c < NCOL; ++c) m4[c % 4] = fmaxf(m4[c % 4], s[r][c]);
      float m = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      float ms = m * scale;
      float p4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c = 0; c < NCOL; ++c) {
        float x = fmaf(s[r][c], scale, -ms);
        s[r][c] = (c % 8 < EMUL) ? ex2_poly(x) : ex2(x);
        p4[c % 4] += s[r][c];
      }
      l[r] = l[r] * 0.5f + ((p4[0] + p4[1]) + (p4[2] + p4[3]));
#pragma unroll
      for (int c = 0; c < NCOL; c += 4) acc ^= e4m3x4(s[r][c], s[r][c + 1], s[r][c + 2], s[r][c + 3]);
    }
  }
  __syncthreads();
  long long t1 = clock64();
  if (acc == 0x12345678u || l[0] + l[1] == 1.2345f) sink[0] = acc;
  if (threadIdx.x == 0) clk[blockIdx.x] = t1 - t0;
}

// pipe test: 8 chains of ex2 per thread; CVT adds one e4m3x2 conversion per two ex2 (the kernel's ratio)
template <int CVT>
__global__ void pipes(uint32_t* sink, long long* clk) {
  float v[8];
  for (int c = 0; c < 8; ++c) v[c] = -0.001f * (threadIdx.x + c);
  uint32_t acc = 0;
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < 2048; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) v[c] = ex2(v[c]) - 1.5f;
    if (CVT) {
#pragma unroll
      for (int c = 0; c < 8; c += 4) acc += e4m3x4(v[c], v[c + 1], v[c + 2], v[c + 3]);
    }
  }
  __syncthreads();
  long long t1 = clock64();
  float t = 0.f;
  for (int c = 0; c < 8; ++c) t += v[c];
  if (acc == 0x12345678u || t == 1.2345f) sink[0] = acc;
  if (threadIdx.x == 0) clk[blockIdx.x] = t1 - t0;
}

static double mean_clk(long long* dclk, int n) {
  long long h[1024];
  cudaMemcpy(h, dclk, n * sizeof(long long), cudaMemcpyDeviceToHost);
  double m = 0;
  for (int i = 0; i < n; ++i) m += h[i];
  return m / n;
}

template <int EMUL>
int tile(int nsm, int warps_per_sched, uint32_t* sink, long long* clk) {
  int threads = 128 * warps_per_sched;
  softmax_tile<EMUL><<<nsm, threads>>>(sink, clk, 1.4427f);
  CK(cudaDeviceSynchronize());
  softmax_tile<EMUL><<<nsm, threads>>>(sink, clk, 1.4427f);
  CK(cudaDeviceSynchronize());
  double per_tile = mean_clk(clk, nsm) / ITERS;
  // 96 scores per thread, 128 threads = one warpgroup's 64 x 192 tile per warp per scheduler
  printf("softmax of a 64x192 tile, %d warp(s)/scheduler, %d/8 columns on the polynomial: %7.1f clk per tile-iteration"
         " (%6.1f per warp-tile)\n", warps_per_sched, EMUL, per_tile, per_tile / warps_per_sched);
  return 0;
}

int main() {
  int nsm = 0;
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  uint32_t* sink; long long* clk;
  CK(cudaMalloc(&sink, 4)); CK(cudaMalloc(&clk, 1024 * sizeof(long long)));
  for (int cvt = 0; cvt < 2; ++cvt) {
    int threads = 512;
    if (cvt) pipes<1><<<nsm, threads>>>(sink, clk); else pipes<0><<<nsm, threads>>>(sink, clk);
    CK(cudaDeviceSynchronize());
    if (cvt) pipes<1><<<nsm, threads>>>(sink, clk); else pipes<0><<<nsm, threads>>>(sink, clk);
    CK(cudaDeviceSynchronize());
    double c = mean_clk(clk, nsm);
    double ex2_per_clk = double(threads) * 8 * 2048 / c;
    printf("ex2 x8 %s: %.2f ex2/clk/SM (%.0f clk)\n", cvt ? "+ 2 e4m3x4 (4 cvt.e4m3x2)" : "alone             ", ex2_per_clk, c);
  }
  for (int w = 1; w <= 2; ++w) {
    tile<0>(nsm, w, sink, clk);
    tile<1>(nsm, w, sink, clk);
    tile<2>(nsm, w, sink, clk);
    tile<3>(nsm, w, sink, clk);
    tile<4>(nsm, w, sink, clk);
  }
  return 0;
}
