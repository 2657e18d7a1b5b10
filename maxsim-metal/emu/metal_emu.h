// A small emulator of the Metal compute model, enough to run maxsim.metal
// (compiled as C++17) on the CPU with the same grid, threadgroup size,
// buffer bindings and threadgroup memory as a real dispatch.
//
// Execution model: every SIMT thread of a threadgroup is a real thread of
// control (a fiber with its own stack, or an OS thread), so barriers and
// SIMD-group exchanges are executed, not simulated away:
//   * threadgroup_barrier      waits for every thread of the threadgroup,
//   * simd_* / simdgroup_*     exchange values through a per-SIMD-group
//                              mailbox (32 lanes) and wait on its own barrier.
// Each SIMD-group operation checks that all 32 lanes reach the same operation
// (same sequence number and kind, same arguments for simdgroup_load/store);
// divergent SIMD operations, barriers not reached by every thread (deadlock),
// unbound buffers, parameter structs whose size differs between host and
// shader, and writes past the threadgroup memory the host asked for are all
// reported as errors.
//
// simdgroup_matrix<T, 8, 8> holds two elements per lane (thread_elements())
// in the lane layout Apple GPUs use (the one MLX relies on); multiply-
// accumulate gathers the 64 elements of each operand through the mailbox.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

// ===========================================================================
// Vector types and half (namespace metal, as in <metal_stdlib>)
// ===========================================================================
namespace metal {

template <class T>
struct vec2 {
  T x, y;
  vec2() = default;
  constexpr vec2(T s) : x(s), y(s) {}
  constexpr vec2(T a, T b) : x(a), y(b) {}
  template <class U>
  explicit constexpr vec2(const vec2<U>& o) : x(T(o.x)), y(T(o.y)) {}
  T& operator[](int i) { return i == 0 ? x : y; }
  const T& operator[](int i) const { return i == 0 ? x : y; }
};
template <class T>
struct vec3 {
  T x, y, z;
  vec3() = default;
  constexpr vec3(T s) : x(s), y(s), z(s) {}
  constexpr vec3(T a, T b, T c) : x(a), y(b), z(c) {}
  template <class U>
  explicit constexpr vec3(const vec3<U>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  T& operator[](int i) { return i == 0 ? x : (i == 1 ? y : z); }
  const T& operator[](int i) const { return i == 0 ? x : (i == 1 ? y : z); }
  vec2<T> xy() const { return vec2<T>(x, y); }
};
template <class T>
struct vec4 {
  T x, y, z, w;
  vec4() = default;
  constexpr vec4(T s) : x(s), y(s), z(s), w(s) {}
  constexpr vec4(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <class U>
  explicit constexpr vec4(const vec4<U>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  T& operator[](int i) { return i == 0 ? x : (i == 1 ? y : (i == 2 ? z : w)); }
  const T& operator[](int i) const { return i == 0 ? x : (i == 1 ? y : (i == 2 ? z : w)); }
};

#define MS_EMU_VEC_OPS(V, N)                                                        \
  template <class T>                                                                \
  inline V<T> operator+(V<T> a, const V<T>& b) {                                    \
    for (int i = 0; i < N; ++i) a[i] = a[i] + b[i];                                 \
    return a;                                                                       \
  }                                                                                 \
  template <class T>                                                                \
  inline V<T> operator-(V<T> a, const V<T>& b) {                                    \
    for (int i = 0; i < N; ++i) a[i] = a[i] - b[i];                                 \
    return a;                                                                       \
  }                                                                                 \
  template <class T>                                                                \
  inline V<T> operator*(V<T> a, const V<T>& b) {                                    \
    for (int i = 0; i < N; ++i) a[i] = a[i] * b[i];                                 \
    return a;                                                                       \
  }                                                                                 \
  template <class T>                                                                \
  inline V<T> operator/(V<T> a, const V<T>& b) {                                    \
    for (int i = 0; i < N; ++i) a[i] = a[i] / b[i];                                 \
    return a;                                                                       \
  }                                                                                 \
  template <class T>                                                                \
  inline V<T> operator*(V<T> a, T s) {                                              \
    for (int i = 0; i < N; ++i) a[i] = a[i] * s;                                    \
    return a;                                                                       \
  }                                                                                 \
  template <class T>                                                                \
  inline bool operator==(const V<T>& a, const V<T>& b) {                            \
    for (int i = 0; i < N; ++i)                                                     \
      if (!(a[i] == b[i])) return false;                                            \
    return true;                                                                    \
  }
MS_EMU_VEC_OPS(vec2, 2)
MS_EMU_VEC_OPS(vec3, 3)
MS_EMU_VEC_OPS(vec4, 4)
#undef MS_EMU_VEC_OPS

// IEEE binary16, converted exactly as Metal does (round to nearest even).
namespace detail {
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
  return bits_f32(r);
}
}  // namespace detail

struct half {
  uint16_t bits;
  half() = default;
  half(float f) : bits(detail::f32_to_f16(f)) {}
  operator float() const { return detail::f16_to_f32(bits); }
};
static_assert(sizeof(half) == 2, "half must be 2 bytes");

typedef vec2<float> float2;
typedef vec3<float> float3;
typedef vec4<float> float4;
typedef vec2<half> half2;
typedef vec3<half> half3;
typedef vec4<half> half4;
typedef vec2<int> int2;
typedef vec3<int> int3;
typedef vec4<int> int4;
typedef vec2<uint> uint2;
typedef vec3<uint> uint3;
typedef vec4<uint> uint4;
typedef vec2<short> short2;
typedef vec4<short> short4;
typedef vec2<ushort> ushort2;
typedef vec3<ushort> ushort3;
typedef vec4<ushort> ushort4;
typedef vec2<uchar> uchar2;
typedef vec4<uchar> uchar4;
typedef vec2<long> long2;
typedef vec2<ulong> ulong2;
typedef vec3<ulong> ulong3;

template <class To, class From>
inline To as_type(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of equal size");
  To r;
  std::memcpy(&r, &v, sizeof(To));
  return r;
}

template <class T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
inline T max(T a, T b) {
  return a < b ? b : a;
}
template <class T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float abs(float a) { return std::fabs(a); }
inline int abs(int a) { return a < 0 ? -a : a; }
inline float sqrt(float a) { return std::sqrt(a); }
inline bool isnan(float a) { return std::isnan(a); }
inline bool isinf(float a) { return std::isinf(a); }
template <class T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}

enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

}  // namespace metal

// ===========================================================================
// Runtime interface (implemented in emu_runtime.cpp)
// ===========================================================================
namespace emu {

// Thrown inside emulated threads to unwind them once the launch has failed.
struct Abort {};

enum SimdOp : int {
  kOpBarrier = 1,
  kOpShuffle,
  kOpReduce,
  kOpVote,
  kOpMatLoad,
  kOpMatStore,
  kOpMatMul,
};

enum Attr : int {
  kThreadPositionInGrid,
  kThreadgroupPositionInGrid,
  kThreadPositionInThreadgroup,
  kThreadIndexInThreadgroup,
  kThreadsPerThreadgroup,
  kThreadgroupsPerGrid,
  kSimdgroupIndexInThreadgroup,
  kThreadIndexInSimdgroup,
  kThreadsPerSimdgroup,
  kSimdgroupsPerThreadgroup,
};

struct ThreadCtx;

ThreadCtx* current();
unsigned lane_of(const ThreadCtx& c);
// The 32 x 64-byte mailbox of the SIMD group for the next operation (two
// buffers alternate, so one barrier per operation suffices); lane l's slot
// is at offset 64 * l.
unsigned char* simd_mailbox(ThreadCtx& c);
// Barrier over the SIMD group; every lane must be at the same operation.
void simd_sync(ThreadCtx& c, int op);
void tg_barrier(ThreadCtx& c);
[[noreturn]] void fail(const std::string& msg);
unsigned attr(int which, int comp);
const void* buffer_binding(int index, size_t* bytes, bool* is_bytes);
void* threadgroup_binding(int index);

struct Registrar {
  Registrar(const char* name, void (*fn)());
};

// Default arguments of the shader entry points (MS_ATTR(buffer(n)) etc.).
struct BufferArg {
  int index;
  template <class P>
  operator P() const {
    size_t bytes = 0;
    bool is_bytes = false;
    const void* ptr = buffer_binding(index, &bytes, &is_bytes);
    if constexpr (std::is_pointer<P>::value) {
      return static_cast<P>(const_cast<void*>(ptr));
    } else {
      if (bytes != sizeof(P))
        fail("buffer " + std::to_string(index) + ": the shader reads a " + std::to_string(sizeof(P)) +
             "-byte struct, the host bound " + std::to_string(bytes) + " bytes");
      P v;
      std::memcpy(static_cast<void*>(&v), ptr, sizeof(P));
      return v;
    }
  }
};

struct ThreadgroupArg {
  int index;
  template <class P>
  operator P() const {
    static_assert(std::is_pointer<P>::value, "threadgroup arguments are pointers");
    return static_cast<P>(threadgroup_binding(index));
  }
};

inline metal::uint3 attr3(int which) {
  return metal::uint3(attr(which, 0), attr(which, 1), attr(which, 2));
}

// --- SIMD-group exchange helpers -------------------------------------------
// Every lane contributes v; afterwards `box` holds all 32 contributions
// (lane l's at box + 64 * l) until the next-but-one operation.
template <class T>
inline unsigned char* exchange(ThreadCtx& c, const T& v, int op) {
  static_assert(sizeof(T) <= 64 && std::is_trivially_copyable<T>::value, "exchange payload");
  unsigned char* box = simd_mailbox(c);
  std::memcpy(box + 64 * lane_of(c), &v, sizeof(T));
  simd_sync(c, op);
  return box;
}
template <class T>
inline T slot_value(const unsigned char* box, int lane) {
  T v;
  std::memcpy(static_cast<void*>(&v), box + 64 * lane, sizeof(T));
  return v;
}
template <class T>
inline void exchange_all(T v, T* out, int op) {
  const unsigned char* box = exchange(*current(), v, op);
  for (int l = 0; l < 32; ++l) out[l] = slot_value<T>(box, l);
}
template <class T>
inline T exchange_get(T v, int src, int op) {
  return slot_value<T>(exchange(*current(), v, op), src);
}

}  // namespace emu

// ===========================================================================
// SIMD-group functions, barriers, simdgroup_matrix (namespace metal)
// ===========================================================================
namespace metal {

inline void threadgroup_barrier(mem_flags) { emu::tg_barrier(*emu::current()); }
inline void simdgroup_barrier(mem_flags) { emu::simd_sync(*emu::current(), emu::kOpBarrier); }

inline ushort emu_lane() { return ushort(emu::lane_of(*emu::current())); }

template <class T>
inline T simd_shuffle(T v, ushort src) {
  if (src >= 32) emu::fail("simd_shuffle: lane index >= 32");
  return emu::exchange_get(v, src, emu::kOpShuffle);
}
template <class T>
inline T simd_broadcast(T v, ushort src) {
  return simd_shuffle(v, src);
}
template <class T>
inline T simd_broadcast_first(T v) {
  return emu::exchange_get(v, 0, emu::kOpShuffle);
}
template <class T>
inline T simd_shuffle_xor(T v, ushort mask) {
  if (mask >= 32) emu::fail("simd_shuffle_xor: mask >= 32");
  return emu::exchange_get(v, emu_lane() ^ mask, emu::kOpShuffle);
}
template <class T>
inline T simd_shuffle_down(T v, ushort delta) {
  const int l = emu_lane();
  return emu::exchange_get(v, l + delta < 32 ? l + delta : l, emu::kOpShuffle);
}
template <class T>
inline T simd_shuffle_up(T v, ushort delta) {
  const int l = emu_lane();
  return emu::exchange_get(v, l >= delta ? l - delta : l, emu::kOpShuffle);
}
template <class T>
inline T simd_shuffle_rotate_down(T v, ushort delta) {
  return emu::exchange_get(v, (emu_lane() + delta) % 32, emu::kOpShuffle);
}
template <class T>
inline T simd_shuffle_rotate_up(T v, ushort delta) {
  return emu::exchange_get(v, (emu_lane() + 32 - delta % 32) % 32, emu::kOpShuffle);
}

// Reductions combine the lanes in lane order (the hardware order is not
// specified; every result here is order-independent or fp32-exact in tests).
template <class T, class F>
inline T emu_reduce(T v, F f) {
  T all[32];
  emu::exchange_all(v, all, emu::kOpReduce);
  T r = all[0];
  for (int l = 1; l < 32; ++l) r = f(r, all[l]);
  return r;
}
template <class T>
inline T simd_sum(T v) {
  return emu_reduce(v, [](T a, T b) { return T(a + b); });
}
template <class T>
inline T simd_product(T v) {
  return emu_reduce(v, [](T a, T b) { return T(a * b); });
}
template <class T>
inline T simd_max(T v) {
  return emu_reduce(v, [](T a, T b) { return b > a ? b : a; });
}
template <class T>
inline T simd_min(T v) {
  return emu_reduce(v, [](T a, T b) { return b < a ? b : a; });
}
template <class T>
inline T simd_and(T v) {
  return emu_reduce(v, [](T a, T b) { return T(a & b); });
}
template <class T>
inline T simd_or(T v) {
  return emu_reduce(v, [](T a, T b) { return T(a | b); });
}
template <class T>
inline T simd_xor(T v) {
  return emu_reduce(v, [](T a, T b) { return T(a ^ b); });
}
template <class T>
inline T simd_prefix_exclusive_sum(T v) {
  T all[32];
  emu::exchange_all(v, all, emu::kOpReduce);
  T r = T(0);
  for (int l = 0; l < emu_lane(); ++l) r = T(r + all[l]);
  return r;
}
template <class T>
inline T simd_prefix_inclusive_sum(T v) {
  T all[32];
  emu::exchange_all(v, all, emu::kOpReduce);
  T r = T(0);
  for (int l = 0; l <= emu_lane(); ++l) r = T(r + all[l]);
  return r;
}

struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  explicit simd_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xffffffffull; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool b) {
  bool all[32];
  emu::exchange_all(b, all, emu::kOpVote);
  ulong m = 0;
  for (int l = 0; l < 32; ++l)
    if (all[l]) m |= 1ull << l;
  return simd_vote(m);
}
inline bool simd_any(bool b) { return simd_ballot(b).any(); }
inline bool simd_all(bool b) { return simd_ballot(b).all(); }

// --- simdgroup_matrix --------------------------------------------------------
// Lane l holds row r, columns c and c+1 of the 8x8 matrix.
inline void emu_frag_coord(unsigned lane, int& r, int& c) {
  const unsigned qid = lane >> 2;
  r = int((qid & 4u) + ((lane >> 1) & 3u));
  c = int((qid & 2u) * 2u + (lane & 1u) * 2u);
}

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator implements 8x8 simdgroup matrices");
  vec2<T> elems;
  simdgroup_matrix() = default;
  // Metal: a diagonal matrix with `dval` on the diagonal.
  explicit simdgroup_matrix(T dval) {
    int r, c;
    emu_frag_coord(emu_lane(), r, c);
    elems.x = (r == c) ? dval : T(0);
    elems.y = (r == c + 1) ? dval : T(0);
  }
  vec2<T>& thread_elements() { return elems; }
  const vec2<T>& thread_elements() const { return elems; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elems.x = value;
  m.elems.y = value;
  return m;
}

namespace detail {
struct MatArgs {
  const void* ptr;
  ulong epr, ox, oy;
  int transpose;
  bool operator==(const MatArgs& o) const {
    return ptr == o.ptr && epr == o.epr && ox == o.ox && oy == o.oy && transpose == o.transpose;
  }
};
inline void check_uniform(const MatArgs& a, int op, const char* what) {
  const unsigned char* box = emu::exchange(*emu::current(), a, op);
  if (!(a == emu::slot_value<MatArgs>(box, 0)))  // every lane checks itself against lane 0
    emu::fail(std::string(what) + ": lanes disagree on the source/destination (non-uniform call)");
  if (a.transpose && (a.ox != 0 || a.oy != 0))
    emu::fail(std::string(what) + ": transposed access with a matrix origin is not emulated");
  if (a.epr < 8 && !a.transpose)
    emu::fail(std::string(what) + ": elements_per_row < 8");
}
// Element (r, c) of the matrix, in memory with `epr` elements per row.
inline ulong mat_offset(const MatArgs& a, int r, int c) {
  return a.transpose ? ulong(c) * a.epr + ulong(r) : (a.oy + ulong(r)) * a.epr + a.ox + ulong(c);
}
}  // namespace detail

template <class T, class U>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const U* src, ulong elements_per_row = 8,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same<typename std::remove_cv<U>::type, T>::value,
                "simdgroup_load: pointer and matrix element types differ");
  detail::MatArgs a{src, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix ? 1 : 0};
  detail::check_uniform(a, emu::kOpMatLoad, "simdgroup_load");
  int r, c;
  emu_frag_coord(emu_lane(), r, c);
  d.elems.x = src[detail::mat_offset(a, r, c)];
  d.elems.y = src[detail::mat_offset(a, r, c + 1)];
}

template <class T, class U>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, U* dst, ulong elements_per_row = 8,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same<U, T>::value, "simdgroup_store: pointer and matrix element types differ");
  detail::MatArgs a{dst, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix ? 1 : 0};
  detail::check_uniform(a, emu::kOpMatStore, "simdgroup_store");
  int r, c;
  emu_frag_coord(emu_lane(), r, c);
  dst[detail::mat_offset(a, r, c)] = m.elems.x;
  dst[detail::mat_offset(a, r, c + 1)] = m.elems.y;
}

namespace detail {
struct MmaPayload {
  float a[2], b[2], c[2];
};
// Lane holding element (r, c) of a fragment (inverse of emu_frag_coord).
inline int frag_owner(int r, int c) {
  struct Table {
    signed char lane[8][8];
    Table() {
      for (unsigned l = 0; l < 32; ++l) {
        int rr, cc;
        emu_frag_coord(l, rr, cc);
        lane[rr][cc] = lane[rr][cc + 1] = (signed char)l;
      }
    }
  };
  static const Table t;
  return t.lane[r][c];
}
// Gathers the operands (as fp32) through the SIMD group's mailbox and returns
// this lane's two elements of d = a * b + c, accumulated in fp32 along k.
inline void mma_lane(const float (&a)[2], const float (&b)[2], const float (&c)[2], float (&out)[2]) {
  const MmaPayload mine{{a[0], a[1]}, {b[0], b[1]}, {c[0], c[1]}};
  const unsigned char* box = emu::exchange(*emu::current(), mine, emu::kOpMatMul);
  int r, cc;
  emu_frag_coord(emu_lane(), r, cc);
  float arow[8];
  for (int k = 0; k < 8; k += 2) {
    const MmaPayload o = emu::slot_value<MmaPayload>(box, frag_owner(r, k));
    arow[k] = o.a[0], arow[k + 1] = o.a[1];
  }
  for (int j = 0; j < 2; ++j) {
    float s = c[j];
    for (int k = 0; k < 8; ++k) {
      const MmaPayload o = emu::slot_value<MmaPayload>(box, frag_owner(k, cc + j));
      s = std::fma(arow[k], o.b[(cc + j) & 1], s);
    }
    out[j] = s;
  }
}
}  // namespace detail

template <class T, class U, class V>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                                          const simdgroup_matrix<V, 8, 8>& b,
                                          const simdgroup_matrix<T, 8, 8>& c) {
  const float fa[2] = {float(a.elems.x), float(a.elems.y)};
  const float fb[2] = {float(b.elems.x), float(b.elems.y)};
  const float fc[2] = {float(c.elems.x), float(c.elems.y)};
  float out[2];
  detail::mma_lane(fa, fb, fc, out);
  d.elems.x = T(out[0]);
  d.elems.y = T(out[1]);
}

template <class T, class U, class V>
inline void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                               const simdgroup_matrix<V, 8, 8>& b) {
  const float fa[2] = {float(a.elems.x), float(a.elems.y)};
  const float fb[2] = {float(b.elems.x), float(b.elems.y)};
  const float fc[2] = {0.f, 0.f};
  float out[2];
  detail::mma_lane(fa, fb, fc, out);
  d.elems.x = T(out[0]);
  d.elems.y = T(out[1]);
}

}  // namespace metal

// ===========================================================================
// Host-side launch API (used by the emulator binding)
// ===========================================================================
#include <map>
#include <vector>

namespace emu {

struct Binding {
  const void* ptr = nullptr;
  size_t bytes = 0;
  bool set = false;
  bool is_bytes = false;
  std::vector<unsigned char> data;  // setBytes copies, as Metal does
};

constexpr int kMaxBuffers = 31;  // Metal: buffer indices 0..30

struct Launch {
  std::string kernel;  // Metal function name
  long grid[3] = {1, 1, 1};      // threadgroups (dispatchThreadgroups)
  long threads[3] = {1, 1, 1};   // threads per threadgroup
  long smem_bytes = 0;           // setThreadgroupMemoryLength:atIndex:0
  Binding buffers[kMaxBuffers];
  void set_buffer(int index, const void* ptr, size_t bytes);
  void set_bytes(int index, const void* ptr, size_t bytes);
};

enum Mode : int { kFibers = 0, kUcontext = 1, kThreads = 2 };
struct Config {
  int mode = kFibers;      // kFibers: hand-written context switch where available, else ucontext
  int workers = 0;         // OS threads running threadgroups concurrently (0: hardware)
  double timeout_s = 60;   // kThreads: a barrier waiting longer is a deadlock
  // Fiber schedule: 0 round robin; otherwise a pseudo-random runnable fiber is
  // resumed at every switch (seeded with `schedule`), so that threadgroup
  // memory races between barriers change the results instead of hiding.
  unsigned schedule = 0;
};
Config& config();
bool fibers_native();  // whether kFibers uses the hand-written switch

void run(const Launch& launch);  // throws std::runtime_error on any emulation error
std::vector<std::string> kernel_names();
std::map<std::string, long> launch_counts();

}  // namespace emu
