// Copy-engine ceiling for paged-KV decode on Hopper: how fast can a persistent kernel with
// decode's shape (2 CTAs/SM, 128 threads, 3 stages of 64 K rows + 64 V rows, hd128 bf16, rows
// gathered through a page table, each warp reading its 16 rows back with ldmatrix) move KV
// from HBM into shared memory, with each of the copy mechanisms Hopper offers?
//
//   cpasync16  16-byte cp.async per thread into the 128-byte-swizzled tile (what decode does)
//   bulkrow    one cp.async.bulk of 256 bytes per row into padded rows (stride 272 B), mbarrier
//   tmarow     one TMA tensor copy per row and 64-column half (box 64 x 1, 128-byte swizzle)
//   tma16      one TMA tensor copy per 16-token page run and half (box 64 x 1 x 16); page % 16 == 0
//
// The engines' runs do no math: the bound they measure is the copy path's.  Each engine's result
// is checked (a position-weighted sum of every word read, against the host's sum over the cache).
// The "+mma" modes add decode's per-block math (mma.sync QK^T, online softmax, PV) to cpasync16,
// then variants of its per-item epilogue (see the names in main()).  Cases: decode's benchmark
// shapes from HBM, and a 16 MB cache read 64 times over (L2-resident).  Findings: BENCHMARKS.md,
// "What bounds decode" (docs/history/benchmarks-notebook.md).
// Build: nvcc -O3 -arch=sm_90a -std=c++17 kv_copy_engines.cu -o kv_copy_engines
// Run:   ./kv_copy_engines   (prints one line per case and mode: time, TB/s)
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); exit(1); } } while (0)

constexpr int D = 128, BN = 64, S = 3, THREADS = 128, ROW_BYTES = D * 2, PAD_ROW = ROW_BYTES + 16;
constexpr int SWZ_TILE = BN * ROW_BYTES;  // one stage's K (or V) tile, swizzled layout
constexpr int PAD_TILE = BN * PAD_ROW;

enum Mode { CPASYNC16 = 0, BULKROW = 1, TMAROW = 2, TMA16 = 3 };

struct Args {
  const uint16_t* k; const uint16_t* v; const int* indices;
  int H, batch, page_size, pages_per_req, kv_len, n_items, blocks_per_item, stagger;
  uint32_t* out; uint16_t* obuf;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n"
      ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void bulk(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// byte offset of (row, 16-byte chunk) in a tile: swizzled (64-column halves of 8 x 128 B atoms,
// chunk XOR row % 8, as decode's layout and TMA's 128-byte swizzle) or padded rows
template <int MODE>
__device__ __forceinline__ int tile_off(int r, int c) {
  if (MODE == BULKROW) return r * PAD_ROW + c * 16;
  return (c / 8) * (BN * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16);
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r; asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi)); return r;
}

// COMPUTE: decode's per-block math on the loaded tiles (S = Q K^T on 16 keys per warp, online
// softmax, O += P V over 128 columns, mma.sync m16n8k16); EPI: decode's per-item epilogue (the
// four warps' fp32 O through the last block's stage, summed, 16 x 128 bf16 rows stored)
template <int MODE, bool COMPUTE = false, int EPI = 0, int STORE = 0>
__global__ void __launch_bounds__(THREADS, 2)
kv_copy(Args a, const __grid_constant__ CUtensorMap kmap, const __grid_constant__ CUtensorMap vmap) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr int TILE = MODE == BULKROW ? PAD_TILE : SWZ_TILE;
  uint8_t* sK = smem;
  uint8_t* sV = smem + S * TILE;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + 2 * S * TILE);
  const int tid = threadIdx.x, wid = tid / 32, lane = tid % 32;
  const int G = gridDim.x, cta = blockIdx.x;
  const int my_items = (a.n_items - cta + G - 1) / G;
  const int n_blocks = my_items * a.blocks_per_item;
  // stagger: item ends (epilogues) shifted by a CTA-dependent number of blocks, same work, so
  // that the CTAs' boundaries do not all fall at the same moment (as uneven plans would)
  const int shift = a.stagger ? (cta * 5) % a.blocks_per_item : 0;
  if (MODE != CPASYNC16) {
    if (tid == 0) {
      for (int s = 0; s < S; ++s) mbar_init(smem_u32(&bars[s]), 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }
  // block b of this CTA's stream: item cta + (b / blocks_per_item) * G, its kb-th 64 tokens
  auto block_pos = [&](int b, int& req, int& head, int& tok0) {
    int item = cta + (b / a.blocks_per_item) * G;
    req = (item / a.H) % a.batch; head = item % a.H; tok0 = (b % a.blocks_per_item) * BN;
  };
  // per-thread page lookups for the next block to issue (one block ahead, as decode)
  constexpr int NROWS = MODE == CPASYNC16 ? 8 : 1;
  int pages[NROWS];
  auto lookup = [&](int b) {
    if (b >= n_blocks) return;
    int req, head, tok0; block_pos(b, req, head, tok0);
    for (int i = 0; i < NROWS; ++i) {
      int r = MODE == CPASYNC16 ? tid / 16 + 8 * i
            : MODE == BULKROW ? tid % 64 : MODE == TMAROW ? tid / 2 : (tid % 4) * 16;
      pages[i] = a.indices[req * a.pages_per_req + (tok0 + r) / a.page_size];
    }
  };
  auto issue = [&](int b) {
    if (b < n_blocks) {
      int req, head, tok0; block_pos(b, req, head, tok0);
      int s = b % S;
      uint32_t k0 = smem_u32(sK + s * TILE), v0 = smem_u32(sV + s * TILE), bar = smem_u32(&bars[s]);
      if (MODE == CPASYNC16) {
        int c = tid % 16;
        for (int i = 0; i < 8; ++i) {
          int r = tid / 16 + 8 * i, slot = (tok0 + r) % a.page_size;
          size_t g = ((size_t(pages[i]) * a.page_size + slot) * a.H + head) * D + c * 8;
          cp16(k0 + tile_off<MODE>(r, c), a.k + g);
          cp16(v0 + tile_off<MODE>(r, c), a.v + g);
        }
      } else {
        if (tid == 0) mbar_expect(bar, 2 * SWZ_TILE);
        if (MODE == BULKROW) {
          int r = tid % 64, slot = (tok0 + r) % a.page_size;
          size_t g = ((size_t(pages[0]) * a.page_size + slot) * a.H + head) * D;
          bulk((tid < 64 ? k0 : v0) + r * PAD_ROW, (tid < 64 ? a.k : a.v) + g, ROW_BYTES, bar);
        } else if (MODE == TMAROW) {
          int r = tid / 2, half = tid % 2, slot = (tok0 + r) % a.page_size;
          int row = (pages[0] * a.page_size + slot) * a.H + head;
          tma2d(k0 + half * (BN * 128) + r * 128, &kmap, half * 64, row, bar);
          tma2d(v0 + half * (BN * 128) + r * 128, &vmap, half * 64, row, bar);
        } else if (tid < 16) {  // TMA16: 4 runs of 16 tokens x 2 halves x (K, V)
          int r = (tid % 4) * 16, half = (tid / 4) % 2, slot = (tok0 + r) % a.page_size;
          int tok = pages[0] * a.page_size + slot;
          uint32_t dst = (tid < 8 ? k0 : v0) + half * (BN * 128) + r * 128;
          tma3d(dst, tid < 8 ? &kmap : &vmap, half * 64, head, tok, bar);
        }
      }
    }
    if (MODE == CPASYNC16) asm volatile("cp.async.commit_group;" ::: "memory");
  };

  lookup(0);
  for (int b = 0; b < S - 1; ++b) { issue(b); lookup(b + 1); }
  uint32_t acc = 0;
  float o[16][4], row_m[2] = {-1e30f, -1e30f}, keep = 0.f;
  uint32_t qa[8][4];  // Q fragment (fixed per item; any bits will do)
  for (int i = 0; i < 8; ++i) for (int j = 0; j < 4; ++j) qa[i][j] = 0x3c003c00u ^ (lane * 0x00010001u * (i + j));
  for (int n = 0; n < 16; ++n) for (int j = 0; j < 4; ++j) o[n][j] = 0.f;
  for (int b = 0; b < n_blocks; ++b) {
    if (MODE == CPASYNC16) {
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
    } else {
      mbar_wait(smem_u32(&bars[b % S]), (b / S) & 1);
    }
    __syncthreads();
    issue(b + S - 1);
    lookup(b + S);
    int s = b % S;
    if (COMPUTE) {
      uint32_t kb = smem_u32(sK + s * TILE), vb = smem_u32(sV + s * TILE);
      int row = wid * 16 + lane % 16;
      float sc[2][4] = {};
      for (int cc = 0; cc < 8; ++cc) {  // k-steps of 16 columns: K rows as B (n = 16 keys)
        uint32_t r4[4];
        ldsm4(kb + tile_off<MODE>(row, cc * 2 + lane / 16), r4);
        mma16816(sc[0], qa[cc], r4[0], r4[2]);
        mma16816(sc[1], qa[cc], r4[1], r4[3]);
      }
      float p[2][4];
      for (int h = 0; h < 2; ++h) {  // rows lane/4 and lane/4 + 8
        float m = fmaxf(fmaxf(sc[0][2 * h], sc[0][2 * h + 1]), fmaxf(sc[1][2 * h], sc[1][2 * h + 1])) * 0.0625f;
        m = fmaxf(m, __shfl_xor_sync(~0u, m, 1)); m = fmaxf(m, __shfl_xor_sync(~0u, m, 2));
        float mn = fmaxf(row_m[h], m), corr = exp2f(row_m[h] - mn);
        row_m[h] = mn;
        for (int t = 0; t < 2; ++t) for (int e = 0; e < 2; ++e) p[t][2 * h + e] = exp2f(sc[t][2 * h + e] * 0.0625f - mn);
        for (int n = 0; n < 16; ++n) { o[n][2 * h] *= corr; o[n][2 * h + 1] *= corr; }
      }
      uint32_t pa[4] = {pack_bf16(p[0][0], p[0][1]), pack_bf16(p[0][2], p[0][3]), pack_bf16(p[1][0], p[1][1]),
                        pack_bf16(p[1][2], p[1][3])};
      for (int cc = 0; cc < 8; ++cc) {  // V rows (keys) as B^T: 16 n-tiles of 8 columns
        uint32_t r4[4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r4[0]), "=r"(r4[1]), "=r"(r4[2]), "=r"(r4[3]) : "r"(vb + tile_off<MODE>(row, cc * 2 + lane / 16)));
        mma16816(o[2 * cc], pa, r4[0], r4[1]);
        mma16816(o[2 * cc + 1], pa, r4[2], r4[3]);
      }
      if ((EPI == 1 || EPI == 5) && (b + 1 + shift) % a.blocks_per_item == 0) {  // the item's epilogue, through stage s
        auto obuf = [&](int w) { return reinterpret_cast<float*>((w < 2 ? sK : sV) + s * TILE + (w % 2) * (TILE / 2)); };
        float* sO = obuf(wid);
        __syncthreads();
        for (int n = 0; n < 16; ++n)
          for (int j = 0; j < 4; ++j) sO[(lane / 4 + 8 * (j / 2)) * D + n * 8 + (lane % 4) * 2 + j % 2] = o[n][j];
        __syncthreads();
        int req, head, tok0; block_pos(b, req, head, tok0);
        for (int i = 0; i < (EPI == 5 ? 1 : 4); ++i) {  // 16 (EPI 5: 4) rows x 32 float4 columns
          int idx = tid + i * THREADS, r = idx / 32, c4 = idx % 32;
          float4 t = {0, 0, 0, 0};
          for (int w = 0; w < 4; ++w) {
            float4 x = *reinterpret_cast<float4*>(obuf(w) + r * D + c4 * 4);
            t.x += x.x; t.y += x.y; t.z += x.z; t.w += x.w;
          }
          uint2 packed = {pack_bf16(t.x, t.y), pack_bf16(t.z, t.w)};
          *reinterpret_cast<uint2*>(a.obuf + (size_t(req * a.H + head) * 16 + r) * D + c4 * 4) = packed;
        }
        __syncthreads();
        for (int n = 0; n < 16; ++n) for (int j = 0; j < 4; ++j) o[n][j] = 0.f;
        row_m[0] = row_m[1] = -1e30f;
      }
      if (EPI == 6 && (b + 1 + shift) % a.blocks_per_item == 0) {
        // one barrier: each warp writes its unscaled O rows (the 4 a GQA-4 item has) and its row
        // maxima; the store phase combines the four warps; the next block's barrier guards reuse
        float* sO = reinterpret_cast<float*>((wid < 2 ? sK : sV) + s * TILE + (wid % 2) * (TILE / 2));
        float* sM = reinterpret_cast<float*>(bars + S);
        if (lane < 16) {
          for (int n = 0; n < 16; ++n) {
            sO[(lane / 4) * D + n * 8 + (lane % 4) * 2] = o[n][0];
            sO[(lane / 4) * D + n * 8 + (lane % 4) * 2 + 1] = o[n][1];
          }
          if (lane % 4 == 0) sM[wid * 16 + lane / 4] = row_m[0];
        }
        __syncthreads();
        int req, head, tok0; block_pos(b, req, head, tok0);
        int r = tid / 32, c4 = tid % 32;
        float m_all = -1e30f, f[4];
        for (int w = 0; w < 4; ++w) m_all = fmaxf(m_all, sM[w * 16 + r]);
        float4 t = {0, 0, 0, 0};
        for (int w = 0; w < 4; ++w) {
          f[w] = exp2f(sM[w * 16 + r] - m_all);
          float4 x = *reinterpret_cast<float4*>(
              reinterpret_cast<float*>((w < 2 ? sK : sV) + s * TILE + (w % 2) * (TILE / 2)) + r * D + c4 * 4);
          t.x += x.x * f[w]; t.y += x.y * f[w]; t.z += x.z * f[w]; t.w += x.w * f[w];
        }
        uint2 packed = {pack_bf16(t.x, t.y), pack_bf16(t.z, t.w)};
        uint16_t* dst = a.obuf + (size_t(req * a.H + head) * 16 + r) * D + c4 * 4;
        if (STORE == 0) {
          *reinterpret_cast<uint2*>(dst) = packed;
        } else if (STORE == 1 || STORE == 2) {  // L2 eviction priority of the output lines
          uint64_t pol;
          if (STORE == 1) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
          else asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
          asm volatile("st.global.L2::cache_hint.v2.b32 [%0], {%1, %2}, %3;" ::"l"(dst), "r"(packed.x), "r"(packed.y),
                       "l"(pol) : "memory");
        } else if (STORE == 3) {
          asm volatile("st.global.cs.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(packed.x), "r"(packed.y) : "memory");
        } else if (STORE == 4) {
          keep += __uint_as_float(packed.x ^ packed.y);  // no store
        } else if (STORE == 5) {  // warp r stages its row in smem, lane 0 stores it with one bulk copy
          uint8_t* row = smem + 2 * S * TILE + 512 + r * ROW_BYTES;
          if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the previous row read
          __syncwarp();
          *reinterpret_cast<uint2*>(row + c4 * 8) = packed;
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          __syncwarp();
          if (lane == 0) {
            uint16_t* grow = a.obuf + (size_t(req * a.H + head) * 16 + r) * D;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         ::"l"(grow), "r"(smem_u32(row)), "n"(ROW_BYTES) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
          }
        }
        for (int n = 0; n < 16; ++n) for (int j = 0; j < 4; ++j) o[n][j] = 0.f;
        row_m[0] = row_m[1] = -1e30f;
      }
      if (EPI >= 3 && EPI <= 4 && (b + 1 + shift) % a.blocks_per_item == 0) {
        // 3: the item's state folded into a register and reset (no store); 4: warp 0 stores the 4
        // rows a GQA-4 decode item really has (1 KB), from registers
        if (EPI == 4 && wid == 0 && lane < 16) {
          int req, head, tok0; block_pos(b, req, head, tok0);
          uint16_t* dst = a.obuf + size_t(req * a.H + head) * 16 * D;
          for (int n = 0; n < 16; ++n)
            *reinterpret_cast<uint32_t*>(dst + (lane / 4) * D + n * 8 + (lane % 4) * 2) = pack_bf16(o[n][0], o[n][1]);
        }
        for (int n = 0; n < 16; ++n) for (int j = 0; j < 4; ++j) { keep += o[n][j]; o[n][j] = 0.f; }
        row_m[0] = row_m[1] = -1e30f;
      }
      if (EPI == 2 && (b + 1 + shift) % a.blocks_per_item == 0) {  // no cross-warp merge: each warp stores its rows
        int req, head, tok0; block_pos(b, req, head, tok0);
        uint16_t* dst = a.obuf + size_t(req * a.H + head) * 16 * D;
        for (int n = 0; n < 16; ++n)
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<uint32_t*>(dst + (lane / 4 + 8 * h) * D + n * 8 + (lane % 4) * 2) =
                pack_bf16(o[n][2 * h], o[n][2 * h + 1]);
        for (int n = 0; n < 16; ++n) for (int j = 0; j < 4; ++j) o[n][j] = 0.f;
        row_m[0] = row_m[1] = -1e30f;
      }
    } else {
    // warp w reads its 16 K rows and 16 V rows with ldmatrix.x4 (decode's access pattern)
    for (int t = 0; t < 2; ++t) {
      uint32_t base = smem_u32((t ? sV : sK) + s * TILE);
      int row = wid * 16 + lane % 16;
      for (int cc = 0; cc < 8; ++cc) {
        uint32_t r4[4];
        ldsm4(base + tile_off<MODE>(row, cc * 2 + lane / 16), r4);
        // lane l holds, of matrix j, row (l / 4) and 32-bit word l % 4 of chunk cc*2 + j/2
        for (int j = 0; j < 4; ++j) acc += r4[j] * uint32_t((cc * 2 + j / 2) * 4 + lane % 4 + 1);
      }
    }
    }
  }
  if (STORE == 5 && lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  if (COMPUTE) {
    float f = 0.f; for (int n = 0; n < 16; ++n) for (int j = 0; j < 4; ++j) f += o[n][j];
    acc = __float_as_uint(f + keep);
  }
  a.out[cta * THREADS + tid] = acc;
}

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  void* fn = nullptr; cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

static CUtensorMap make_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides_bytes,
                            const cuuint32_t* box) {
  CUtensorMap m; cuuint32_t es[3] = {1, 1, 1};
  CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims, strides_bytes,
                           box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled failed: %d\n", int(r)); exit(1); }
  return m;
}

int main() {
  int dev; CK(cudaGetDevice(&dev)); cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, dev));
  int clk_khz = 0; CK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, dev));
  printf("device %s, %d SMs, max SM clock %d MHz (B/clk/SM uses it)\n", prop.name, prop.multiProcessorCount, clk_khz / 1000);
  const int H = 8;
  // reps > 1: the items read the cache reps times over (4 x 1k x 8 heads: 16 MB, L2-resident)
  struct Case { int batch, kv_len, page, reps; };
  const Case cases[] = {{64, 4096, 16, 1}, {256, 1024, 16, 1}, {256, 1024, 1, 1}, {64, 4096, 1, 1},
                        {4, 1024, 16, 64}, {4, 1024, 1, 64}};
  std::mt19937 rng(1234);
  for (const Case& cs : cases) {
    size_t tokens = size_t(cs.batch) * cs.kv_len, elems = tokens * H * D;
    int pages_per_req = cs.kv_len / cs.page, n_pages = cs.batch * pages_per_req;
    std::vector<uint16_t> hk(elems), hv(elems);
    uint64_t st = 0x9E3779B97F4A7C15ull * (cs.batch + 7 * cs.page);
    for (auto* h : {&hk, &hv})
      for (size_t i = 0; i < elems; i += 4) {  // xorshift64: four 16-bit words per step
        st ^= st << 13; st ^= st >> 7; st ^= st << 17;
        std::memcpy(&(*h)[i], &st, 8);
      }
    std::vector<int> idx(n_pages); for (int i = 0; i < n_pages; ++i) idx[i] = i;
    std::shuffle(idx.begin(), idx.end(), rng);
    // expected: every row read once; word k of a row weighted k + 1
    uint32_t want = 0;  // (times reps)
    for (const auto* h : {&hk, &hv}) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(h->data());
      for (size_t i = 0; i < elems / 2; ++i) want += w[i] * uint32_t(i % 64 + 1);
    }
    uint16_t *dk, *dv; int* di; uint32_t* dout;
    CK(cudaMalloc(&dk, elems * 2)); CK(cudaMalloc(&dv, elems * 2)); CK(cudaMalloc(&di, n_pages * 4));
    const int grid = 2 * prop.multiProcessorCount;
    CK(cudaMalloc(&dout, grid * THREADS * 4));
    uint16_t* dobuf; CK(cudaMalloc(&dobuf, size_t(cs.batch) * H * 16 * D * 2));
    CK(cudaMemcpy(dk, hk.data(), elems * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, hv.data(), elems * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(di, idx.data(), n_pages * 4, cudaMemcpyHostToDevice));
    Args a{dk, dv, di, H, cs.batch, cs.page, pages_per_req, cs.kv_len, cs.batch * H * cs.reps, cs.kv_len / BN, 0, dout, dobuf};
    // maps: rows of (token, head) for TMAROW; (D, H, token) for TMA16
    cuuint64_t d2[2] = {D, cuuint64_t(tokens) * H}, s2[1] = {D * 2};
    cuuint32_t b2[2] = {64, 1};
    cuuint64_t d3[3] = {D, cuuint64_t(H), cuuint64_t(tokens)}, s3[2] = {D * 2, cuuint64_t(H) * D * 2};
    cuuint32_t b3[3] = {64, 1, 16};
    using Kern = void (*)(Args, CUtensorMap, CUtensorMap);
    const Kern kerns[] = {kv_copy<0>, kv_copy<1>, kv_copy<2>, kv_copy<3>, kv_copy<0, true>, kv_copy<0, true, 1>,
                          kv_copy<0, true, 2>, kv_copy<0, true, 3>, kv_copy<0, true, 4>, kv_copy<0, true, 5>,
                          kv_copy<0, true, 6>, kv_copy<0, true, 6, 1>, kv_copy<0, true, 6, 2>, kv_copy<0, true, 6, 3>,
                          kv_copy<0, true, 6, 4>, kv_copy<0, true, 6, 5>};
    // +mma: decode's math per block; the rest add an item epilogue: merge3 = the four warps
    // through smem with 3 barriers, all 16 rows stored; nomerge16 = each warp stores its 16
    // rows from registers; reset = state folded and reset, no store; st1KB = warp 0 stores
    // the 4 rows a GQA-4 item has; merge3+1KB / merge1+1KB = 3 or 1 barrier(s), 4 rows
    // stored; then merge1 with L2 evict_last / evict_first / st.cs stores, and without a store
    const char* names[] = {"cpasync16", "bulkrow", "tmarow", "tma16", "+mma", "+mma merge3 16rows",
                           "+mma nomerge16", "+mma reset", "+mma st1KB", "+mma merge3+1KB", "+mma merge1+1KB",
                           "+mma merge1+1KB evict_last", "+mma merge1+1KB evict_first", "+mma merge1+1KB st.cs",
                           "+mma merge1 no store", "+mma merge3 16rows, stagger", "+mma merge1+1KB, stagger",
                           "+mma merge1+1KB bulk store"};
    for (int m = 0; m < 18; ++m) {
      // 15, 16: staggered epilogues; 17: the 1 KB stored by one bulk copy per row
      const int mode = m < 15 ? m : (m == 15 ? 5 : m == 16 ? 10 : 15);
      a.stagger = m == 15 || m == 16;
      if (mode == TMA16 && cs.page % 16) continue;
      double bytes = double(a.n_items) * a.blocks_per_item * BN * ROW_BYTES * 2;
      CUtensorMap km = mode == TMA16 ? make_map(dk, 3, d3, s3, b3) : make_map(dk, 2, d2, s2, b2);
      CUtensorMap vm = mode == TMA16 ? make_map(dv, 3, d3, s3, b3) : make_map(dv, 2, d2, s2, b2);
      int smem = 2 * S * (mode == BULKROW ? PAD_TILE : SWZ_TILE) + 1024 + 512 + 4 * ROW_BYTES;
      Kern fn = kerns[mode];
      CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      CK(cudaMemset(dout, 0xFF, grid * THREADS * 4));
      fn<<<grid, THREADS, smem>>>(a, km, vm); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
      std::vector<uint32_t> out(grid * THREADS); CK(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost));
      uint32_t got = 0; for (auto x : out) got += x;
      std::vector<float> ms;
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      for (int it = 0; it < 25; ++it) {
        cudaEventRecord(e0); fn<<<grid, THREADS, smem>>>(a, km, vm); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float t; cudaEventElapsedTime(&t, e0, e1); if (it >= 5) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      float med = ms[ms.size() / 2];
      int occ = 0; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, THREADS, smem);
      printf("batch %3d kv %5d page %2d x%-2d %-27s ctas/SM %d  %s  %.4f ms  %.3f TB/s  %.1f B/clk/SM\n", cs.batch, cs.kv_len, cs.page, cs.reps,
             names[m], occ, mode >= 4 ? "n/a" : got == want * uint32_t(cs.reps) ? "ok " : "BAD", med,
             bytes / (med * 1e-3) / 1e12, bytes / (med * 1e-3) / prop.multiProcessorCount / (clk_khz * 1e3));
    }
    cudaFree(dk); cudaFree(dv); cudaFree(di); cudaFree(dout); cudaFree(dobuf);
  }
  return 0;
}
