// Read-only streaming kernels for benchmarks/read_floor.py: the time to touch
// every byte of a tensor once, the floor of any exact MaxSim over those bytes.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

template <int POL>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  uint4 v;
  if constexpr (POL == 0) {  // plain
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (POL == 1) {  // .cs (streaming) + 256 B prefetch, as the maxsim streaming kernel
    asm volatile("ld.global.cs.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {  // plain nc + 256 B prefetch
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  }
  return v;
}

// A warp reads vectors [b, e) of d, U loads of 512 B in flight per step, and
// folds them into one word (so the loads stay live).
template <int POL, int U>
__device__ __forceinline__ uint32_t read_range(const uint4* __restrict__ d, int64_t b, int64_t e, int lane) {
  uint32_t acc = 0;
  for (int64_t i = b + lane; i < e; i += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = (i + 32 * u < e) ? ld16<POL>(d + i + 32 * u) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  return acc;
}

// Warp w of NW reads blocks w, w + NW, w + 2 NW, ... of blk16 vectors. With
// blk16 = n16 / NW (rounded up) that is one contiguous chunk per warp (an
// even split); with small blocks all warps sweep the tensor together, so the
// bytes in flight sit in a narrow window instead of one stream per warp.
template <int POL, int U>
__global__ void __launch_bounds__(256) read_kernel(const uint4* __restrict__ d, int64_t n16, int64_t blk16,
                                                   uint32_t* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nw = (int64_t(gridDim.x) * blockDim.x) >> 5;
  uint32_t acc = 0;
  for (int64_t b = warp * blk16; b < n16; b += nw * blk16) acc ^= read_range<POL, U>(d, b, min(b + blk16, n16), lane);
  if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads alive; practically never true
}

static void launch_read(torch::Tensor d, torch::Tensor out, int64_t pol, int64_t warps, int64_t blk16) {
  const int64_t n16 = d.numel() * d.element_size() / 16;
  if (blk16 <= 0) blk16 = (n16 + warps - 1) / warps;
  const int blocks = (int)((warps * 32 + 255) / 256);
  auto st = c10::cuda::getCurrentCUDAStream();
  auto p = reinterpret_cast<const uint4*>(d.data_ptr());
  auto o = reinterpret_cast<uint32_t*>(out.data_ptr());
  if (pol == 0) read_kernel<0, 8><<<blocks, 256, 0, st>>>(p, n16, blk16, o);
  else if (pol == 1) read_kernel<1, 8><<<blocks, 256, 0, st>>>(p, n16, blk16, o);
  else read_kernel<2, 8><<<blocks, 256, 0, st>>>(p, n16, blk16, o);
}

void read_all(torch::Tensor d, torch::Tensor out, int64_t pol, int64_t warps) { launch_read(d, out, pol, warps, 0); }

void read_sweep(torch::Tensor d, torch::Tensor out, int64_t pol, int64_t warps, int64_t blk16) {
  TORCH_CHECK(blk16 > 0, "read_sweep: blk16 must be positive");
  launch_read(d, out, pol, warps, blk16);
}

// Keeps a replica kernel's loads alive (practically never true); the
// shared-memory touch keeps the dynamic allocation that caps CTAs per SM.
__device__ __forceinline__ void keep_alive(uint32_t acc, uint32_t* smem, uint32_t* out) {
  if (acc == 0x9e3779b9u) {
    smem[threadIdx.x] = acc;
    out[0] = smem[(threadIdx.x + 1) & 127];
  }
}

// Lets a replica kernel take up to 100 KB of dynamic shared memory.
template <class K>
bool smem_opt_in(K kern) {
  return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024) == cudaSuccess;
}

// The same reads split as the streaming launcher splits a scan: head CTAs give
// each of their 4 warps `head16` vectors, the CTAs after them `tail16` each;
// dynamic shared memory caps the CTAs per SM as registers cap the streaming
// kernel's (so the replica runs at its occupancy).
__global__ void __launch_bounds__(128) units_kernel(const uint4* __restrict__ d, int64_t n16, int head_blocks,
                                                    int64_t head16, int64_t tail16, uint32_t* __restrict__ out) {
  extern __shared__ uint32_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int64_t b, len;
  if ((int)blockIdx.x < head_blocks) {
    b = (int64_t(blockIdx.x) * 4 + warp) * head16;
    len = head16;
  } else {
    b = int64_t(head_blocks) * 4 * head16 + (int64_t(blockIdx.x - head_blocks) * 4 + warp) * tail16;
    len = tail16;
  }
  const uint32_t acc = read_range<1, 8>(d, b, min(b + len, n16), lane);
  keep_alive(acc, smem, out);
}

// Pairs of per16 vectors, each read by a group of G consecutive warps (G > 4
// spans CTAs) taking every G-th tile of 2 KB, two tiles in flight per warp:
// the streaming kernel's interleaved split, generalised past one CTA.
__global__ void __launch_bounds__(128) groups_kernel(const uint4* __restrict__ d, int64_t pairs, int64_t per16, int G,
                                                     uint32_t* __restrict__ out) {
  extern __shared__ uint32_t smem[];
  constexpr int kTile16 = 128;  // 8 rows of 256 bytes
  const int lane = threadIdx.x & 31;
  const int64_t gw = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int64_t pair = gw / G;
  const int k = (int)(gw % G);
  uint32_t acc = 0;
  if (pair < pairs) {
    const uint4* base = d + pair * per16;
    const int64_t nt = (per16 + kTile16 - 1) / kTile16;
    for (int64_t t = k; t < nt; t += 2 * G) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int64_t i = (t + (u / 4) * G) * kTile16 + (u % 4) * 32 + lane;
        v[u] = (t + (u / 4) * G < nt && i < per16) ? ld16<1>(base + i) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  keep_alive(acc, smem, out);
}

void read_groups(torch::Tensor d, torch::Tensor out, int64_t pairs, int64_t per16, int64_t G, int64_t smem) {
  static const bool opt_in = smem_opt_in(groups_kernel);
  TORCH_CHECK(opt_in && smem <= 100 * 1024, "read_groups: shared memory opt-in failed");
  TORCH_CHECK(G >= 1 && pairs * per16 * 16 <= d.numel() * d.element_size(), "read_groups: bad split");
  const int64_t blocks = (pairs * G + 3) / 4;
  groups_kernel<<<(unsigned)blocks, 128, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(d.data_ptr()), pairs, per16, (int)G, reinterpret_cast<uint32_t*>(out.data_ptr()));
}

void read_units(torch::Tensor d, torch::Tensor out, int64_t head_blocks, int64_t head16, int64_t tail_blocks,
                int64_t tail16, int64_t smem) {
  static const bool opt_in = smem_opt_in(units_kernel);
  TORCH_CHECK(opt_in && smem <= 100 * 1024, "read_units: shared memory opt-in failed");
  const int64_t n16 = d.numel() * d.element_size() / 16;
  TORCH_CHECK(head_blocks * 4 * head16 + tail_blocks * 4 * tail16 >= n16, "read_units: the split misses bytes");
  units_kernel<<<(unsigned)(head_blocks + tail_blocks), 128, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(d.data_ptr()), n16, (int)head_blocks, head16, tail16,
      reinterpret_cast<uint32_t*>(out.data_ptr()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_all", &read_all);
  m.def("read_sweep", &read_sweep);
  m.def("read_units", &read_units);
  m.def("read_groups", &read_groups);
}
