// Self-test kernels for the emulator itself (not part of the maxsim library):
// they pin down the semantics of the emulated simd_* functions, barriers,
// threadgroup memory and simdgroup_matrix operations against values the test
// computes independently, and deliberately misuse the model to check that the
// emulator reports it. Valid Metal as well, so they can be compared on a Mac.
#if defined(__METAL_VERSION__)
#include <metal_stdlib>
using namespace metal;
#define MS_ATTR(x) [[x]]
#define MS_REGISTER_KERNEL(name)
#endif

// 2 threadgroups x 64 threads; out[gid * 16 + k].
kernel void emu_selftest_simd(device const float* x MS_ATTR(buffer(0)),
                              device float* out MS_ATTR(buffer(1)),
                              threadgroup float* smem MS_ATTR(threadgroup(0)),
                              uint3 gpos MS_ATTR(thread_position_in_grid),
                              uint3 tgpos MS_ATTR(threadgroup_position_in_grid),
                              uint tid MS_ATTR(thread_index_in_threadgroup),
                              uint lane MS_ATTR(thread_index_in_simdgroup),
                              uint sgid MS_ATTR(simdgroup_index_in_threadgroup),
                              uint width MS_ATTR(threads_per_simdgroup)) {
  const uint g = gpos.x;
  const float v = x[g];
  device float* o = out + g * 16;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_min(v);
  o[3] = simd_shuffle(v, ushort((lane * 7 + 3) % 32));
  o[4] = simd_shuffle_xor(v, ushort(5));
  o[5] = simd_shuffle_down(v, ushort(3));
  o[6] = simd_shuffle_up(v, ushort(3));
  o[7] = simd_prefix_exclusive_sum(v);
  o[8] = simd_prefix_inclusive_sum(v);
  o[9] = simd_broadcast(v, ushort(9));
  o[10] = simd_any(v > 2.5f) ? 1.f : 0.f;
  o[11] = simd_all(v > -100.f) ? 1.f : 0.f;
  o[12] = float(uint(ulong(simd_ballot(lane < 5))));
  smem[tid] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  o[13] = smem[63 - tid];
  o[14] = float(tgpos.x) * 1000.f + float(sgid) * 100.f + float(width);
  o[15] = float(simd_sum(int(lane)));
}
MS_REGISTER_KERNEL(emu_selftest_simd)

// 1 threadgroup x 32 threads. a, b, c: 8x8 row-major; out: 5 x 64.
//   out[0]   = a * b + c   (b staged transposed and loaded with transpose,
//                           c staged with 12 elements per row at origin (2, 1))
//   out[64]  = (a * b + c)^T (transposed store)
//   out[128] = diagonal matrix of 2.5, out[192] = filled with 1.5
//   out[256] = a * b
kernel void emu_selftest_mma(device const float* a MS_ATTR(buffer(0)),
                             device const float* b MS_ATTR(buffer(1)),
                             device const float* c MS_ATTR(buffer(2)),
                             device float* out MS_ATTR(buffer(3)),
                             threadgroup float* smem MS_ATTR(threadgroup(0)),
                             uint lane MS_ATTR(thread_index_in_simdgroup)) {
  threadgroup float* ta = smem;         // 64
  threadgroup float* tbt = smem + 64;   // 64, b transposed
  threadgroup float* tc = smem + 128;   // 9 rows x 12
  for (uint e = lane; e < 64; e += 32) {
    const uint r = e / 8, k = e % 8;
    ta[e] = a[e];
    tbt[k * 8 + r] = b[e];
  }
  for (uint e = lane; e < 108; e += 32) tc[e] = -7.f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = lane; e < 64; e += 32) tc[(1 + e / 8) * 12 + 2 + e % 8] = c[e];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 ma;
  simdgroup_float8x8 mb;
  simdgroup_float8x8 mc;
  simdgroup_float8x8 md;
  simdgroup_load(ma, ta, 8);
  simdgroup_load(mb, tbt, 8, ulong2(0, 0), true);
  simdgroup_load(mc, tc, 12, ulong2(2, 1));
  simdgroup_multiply_accumulate(md, ma, mb, mc);
  simdgroup_store(md, out, 8);
  simdgroup_store(md, out + 64, 8, ulong2(0, 0), true);
  simdgroup_float8x8 diag(2.5f);
  simdgroup_store(diag, out + 128, 8);
  simdgroup_float8x8 filled = make_filled_simdgroup_matrix<float, 8, 8>(1.5f);
  simdgroup_store(filled, out + 192, 8);
  simdgroup_float8x8 prod;
  simdgroup_multiply(prod, ma, mb);
  simdgroup_store(prod, out + 256, 8);
}
MS_REGISTER_KERNEL(emu_selftest_mma)

// Misuse 1: half the lanes shuffle while the other half reduce.
kernel void emu_selftest_divergent(device float* out MS_ATTR(buffer(0)),
                                   uint lane MS_ATTR(thread_index_in_simdgroup)) {
  float v = float(lane);
  if (lane < 16)
    v = simd_shuffle_xor(v, ushort(1));
  else
    v = simd_sum(v);
  out[lane] = v;
}
MS_REGISTER_KERNEL(emu_selftest_divergent)

// Misuse 2: a threadgroup barrier only the first SIMD group reaches.
kernel void emu_selftest_deadlock(device float* out MS_ATTR(buffer(0)),
                                  uint tid MS_ATTR(thread_index_in_threadgroup)) {
  if (tid < 32) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.f;
}
MS_REGISTER_KERNEL(emu_selftest_deadlock)

// Misuse 3: writes one float past the threadgroup memory the host set.
kernel void emu_selftest_overflow(device const int* n MS_ATTR(buffer(0)),
                                  threadgroup float* smem MS_ATTR(threadgroup(0)),
                                  uint tid MS_ATTR(thread_index_in_threadgroup)) {
  if (tid == 0) smem[n[0]] = 1.f;
}
MS_REGISTER_KERNEL(emu_selftest_overflow)

// Misuse 4: a threadgroup-memory race (no barrier between the write and the
// neighbour's read); its result depends on the schedule.
kernel void emu_selftest_race(device float* out MS_ATTR(buffer(0)),
                              threadgroup float* smem MS_ATTR(threadgroup(0)),
                              uint tid MS_ATTR(thread_index_in_threadgroup)) {
  smem[tid] = float(tid);
  out[tid] = smem[(tid + 1) % 64];
}
MS_REGISTER_KERNEL(emu_selftest_race)
