// Would FA3's ping-pong help the portable prefill (kernels/prefill_mma.py) on mma.sync?  A model of
// its 128-row tile's block loop, registers only (no loads: what is measured is how well the
// softmax of one warp hides under the MMAs of the other warp on its SMSP).  Per 64-key block a
// 32-row warp issues
//   S = Q K^T:   2 M tiles x 8 N tiles x 8 k16 steps = 128 HMMA.16816 (64 fp32 accumulators),
//   the softmax: per row max (4 partial chains + a quad shuffle), one FFMA + ex2 per score, the
//                sum, the correction ex2, the vote of the lazy O rescale, P packed to bf16x2,
//   O += P V:    2 M tiles x 16 N tiles (d 128) x 4 k16 steps = 128 HMMA.16816 (128 accumulators),
// 8 warps per SM (the kernel's occupancy at 255 registers), as:
//   free:      2 CTAs x 4 warps, each warp S -> softmax -> P V on its own (today's kernel, minus
//              its loads and per-block barrier);
//   barrier:   the same with a CTA barrier per block (the kernel's stage barrier);
//   deferred:  1 CTA x 8 warps, each warp {P V of block j-1, S of block j} then the softmax of
//              block j, no coordination (the ping-pong's instruction order without its barriers);
//   defer_bar: deferred in 2 CTAs x 4 warps with two CTA barriers per block (the kernel's defer=1);
//   pingpong:  the same with two 4-warp groups taking turns: a turn {P V j-1, S j} starts at the
//              group's named barrier (its 128 threads + the other group's 128 arrivals) and ends
//              with an arrival at the other group's, the softmax runs during the other's turn.
// TFLOP/s counts the HMMAs only (256 x 4096 FLOP per warp and block), against mma.sync's peak
// (mma_sync_peak.cu: 644 TFLOP/s on the H200).  The kernel's own rate on 2 x 8k causal: 357.
// Build: nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 mma_pingpong.cu -o mma_pingpong
//        (-Xptxas -v: every kernel at <= 255 registers with no spill)
// Run:   ./mma_pingpong
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); return 1; } } while (0)

#ifndef BLOCKS
#define BLOCKS 1024  // 64-key blocks per warp and launch
#endif
constexpr float SCALE = 0.0883883f * 1.44269504f;

__device__ __forceinline__ void hmma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

struct Warp {
  float s[2][8][4];   // S: M tile, N tile (8 keys), the m16n8 accumulator
  float o[2][16][4];  // O: M tile, N tile (8 dims)
  uint32_t p[2][4][4];  // P as the A operand: M tile, k16 step, fragment
  float m[4], l[4];   // per thread: rows (M tile, upper / lower half)
  // stand-in operands in registers (the kernel reads them by ldmatrix); each M tile its own Q, or
  // the compiler merges the two M tiles' identical MMAs
  uint32_t q[2][4], kv[2];

  __device__ void init(uint32_t seed) {
    for (int i = 0; i < 8; ++i) q[i / 4][i % 4] = 0x3c003c00u ^ (seed * (threadIdx.x + i) & 0x00ff00ffu);
    for (int i = 0; i < 2; ++i) kv[i] = 0x3c003c00u ^ (seed * (threadIdx.x + 7 * i) & 0x00ff00ffu);
    for (int i = 0; i < 4; ++i) m[i] = -1e30f, l[i] = 0.f;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 16; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[a][b][c] = 0.f;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) p[a][b][c] = 0;
  }

  __device__ __forceinline__ void scores(int blk) {
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[a][n][c] = 0.f;
    uint32_t k0 = kv[0] ^ (uint32_t)blk, k1 = kv[1];
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int a = 0; a < 2; ++a) hmma(s[a][n], q[a], k0 + k, k1 + n);
  }

  __device__ __forceinline__ void pv() {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int a = 0; a < 2; ++a) hmma(o[a][n], p[a][k], kv[0] + k, kv[1] + n);
  }

  // the flag path's mask-free softmax (kernels/prefill_mma.py ``_softmax``) and the lazy rescale
  __device__ __forceinline__ void softmax() {
    float corr[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int a = r >> 1, h = (r & 1) * 2;
      float part[4] = {-1e30f, -1e30f, -1e30f, -1e30f};
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        part[(2 * n) % 4] = fmaxf(part[(2 * n) % 4], s[a][n][h]);
        part[(2 * n + 1) % 4] = fmaxf(part[(2 * n + 1) % 4], s[a][n][h + 1]);
      }
      float mb = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
      mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
      mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
      const float mn = (mb - m[r]) * SCALE <= 8.f ? m[r] : fmaxf(m[r], mb);
      corr[r] = ex2((m[r] - mn) * SCALE);
      const float ms = mn * SCALE;
      float ps[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        s[a][n][h] = ex2(fmaf(s[a][n][h], SCALE, -ms));
        s[a][n][h + 1] = ex2(fmaf(s[a][n][h + 1], SCALE, -ms));
        ps[(2 * n) % 4] += s[a][n][h];
        ps[(2 * n + 1) % 4] += s[a][n][h + 1];
      }
      l[r] = l[r] * corr[r] + ((ps[0] + ps[1]) + (ps[2] + ps[3]));
      m[r] = mn;
    }
    // P (n tiles 2k, 2k + 1 form k16 step k) before the rescale, as the kernel
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        p[a][k][0] = pack_bf16(s[a][2 * k][0], s[a][2 * k][1]);
        p[a][k][1] = pack_bf16(s[a][2 * k][2], s[a][2 * k][3]);
        p[a][k][2] = pack_bf16(s[a][2 * k + 1][0], s[a][2 * k + 1][1]);
        p[a][k][3] = pack_bf16(s[a][2 * k + 1][2], s[a][2 * k + 1][3]);
      }
    const bool moved = corr[0] != 1.f || corr[1] != 1.f || corr[2] != 1.f || corr[3] != 1.f;
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          o[a][n][0] *= corr[2 * a], o[a][n][1] *= corr[2 * a];
          o[a][n][2] *= corr[2 * a + 1], o[a][n][3] *= corr[2 * a + 1];
        }
    }
  }

  __device__ void sink(float* out) {
    float t = 0.f;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int n = 0; n < 16; ++n) t += o[a][n][0] + o[a][n][1] + o[a][n][2] + o[a][n][3];
    t += l[0] + l[1] + l[2] + l[3];
    if (t == 12345.f) out[threadIdx.x] = t;
  }
};

// S -> softmax -> P V per block; ``cta_barrier``: a barrier per block
template <bool cta_barrier>
__global__ void __launch_bounds__(128, 2) free_order(float* out, uint32_t seed) {
  Warp w;
  w.init(seed);
  for (int j = 0; j < BLOCKS; ++j) {
    if (cta_barrier) __syncthreads();
    w.scores(j);
    w.softmax();
    w.pv();
  }
  w.sink(out);
}

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

// {P V j-1, S j} then softmax j; ``turns``: two 4-warp groups take turns at the tensor pipe
template <bool turns>
__global__ void __launch_bounds__(256, 1) deferred(float* out, uint32_t seed) {
  Warp w;
  w.init(seed);
  const int g = threadIdx.x / 128;  // warps 0-3 and 4-7: one of each group on every SMSP
  if (turns && g == 1) bar_arrive(2, 256);  // group 0 goes first
  for (int j = 0; j < BLOCKS; ++j) {
    if (turns) bar_sync(2 + g, 256);
    if (j > 0) w.pv();
    w.scores(j);
    if (turns) bar_arrive(3 - g, 256);
    w.softmax();
  }
  w.pv();
  if (turns && g == 0) bar_sync(2, 256);  // group 1's last arrival
  w.sink(out);
}

// {P V j-1, S j} then softmax j with a CTA barrier per block, 2 CTAs x 4 warps (the kernel's
// defer=1: its stage barriers)
__global__ void __launch_bounds__(128, 2) deferred_barrier(float* out, uint32_t seed) {
  Warp w;
  w.init(seed);
  for (int j = 0; j < BLOCKS; ++j) {
    __syncthreads();
    if (j > 0) w.pv();
    w.scores(j);
    __syncthreads();
    w.softmax();
  }
  w.pv();
  w.sink(out);
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* out;
  CK(cudaMalloc(&out, 1024 * sizeof(float)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int reps = 10;
  const double flops = 2.0 * 16 * 8 * 16 * 256 * (double)BLOCKS * 8 * sms * reps;  // 8 warps per SM
  auto time = [&](const char* name, auto launch) -> int {
    launch(1);
    CK(cudaEventRecord(e0));
    for (int r = 0; r < reps; ++r) launch(2 + r);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaGetLastError());
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    printf("%-9s %8.3f ms  %6.1f TFLOP/s\n", name, ms / reps, flops / (ms * 1e-3) / 1e12);
    return 0;
  };
  for (int round = 0; round < 3; ++round) {  // in turns: the clocks drift
    time("free", [&](uint32_t s) { free_order<false><<<2 * sms, 128>>>(out, s); });
    time("barrier", [&](uint32_t s) { free_order<true><<<2 * sms, 128>>>(out, s); });
    time("deferred", [&](uint32_t s) { deferred<false><<<sms, 256>>>(out, s); });
    time("pingpong", [&](uint32_t s) { deferred<true><<<sms, 256>>>(out, s); });
    time("defer_bar", [&](uint32_t s) { deferred_barrier<<<2 * sms, 128>>>(out, s); });
  }
  return 0;
}
