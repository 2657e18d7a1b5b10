// Static check of .metal sources without a Metal compiler (clang only):
//   clang++ --target=arm64-apple-macos13 -x c++ -std=c++14 -fsyntax-only -include metal_lint.h maxsim.metal
// The Metal Shading Language is C++14 with address spaces. Here device,
// constant and threadgroup are real clang address spaces, so a pointer passed
// to the wrong address space, a helper parameter without one, or a C++17
// construct fails to compile, which the emulator (where address spaces vanish
// and the dialect is C++17) cannot notice. Only declarations: nothing runs.
// The declarations follow the signatures of <metal_stdlib> for what maxsim uses.
#pragma once

#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#define kernel
#define MS_ATTR(x)
#define MS_REGISTER_KERNEL(name)
#define MS_EMULATOR 1

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

namespace metal {

typedef _Float16 half;  // a scalar, as in Metal (needs an arm64 target: --target=arm64-apple-macos13)

template <class T>
struct vec2 {
  T x, y;
  vec2() = default;
  vec2(T s);
  vec2(T a, T b);
};
template <class T>
struct vec3 {
  T x, y, z;
  vec3() = default;
  vec3(T s);
  vec3(T a, T b, T c);
};
typedef vec2<float> float2;
typedef vec2<ulong> ulong2;
typedef vec3<uint> uint3;
typedef vec2<uint> uint2;

template <class To, class From>
To as_type(From);
template <class T>
T min(T, T);
template <class T>
T max(T, T);
float fma(float, float, float);

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);

template <class T>
T simd_shuffle(T, ushort);
template <class T>
T simd_shuffle_xor(T, ushort);
template <class T>
T simd_shuffle_down(T, ushort);
template <class T>
T simd_shuffle_up(T, ushort);
template <class T>
T simd_broadcast(T, ushort);
template <class T>
T simd_sum(T);
template <class T>
T simd_max(T);
template <class T>
T simd_min(T);
template <class T>
T simd_prefix_exclusive_sum(T);
template <class T>
T simd_prefix_inclusive_sum(T);
struct simd_vote {
  typedef ulong vote_t;
  explicit operator vote_t() const;
  bool all() const;
  bool any() const;
};
simd_vote simd_ballot(bool);
bool simd_any(bool);
bool simd_all(bool);

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T dval);
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;

template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value);

template <class T, int Cols, int Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const threadgroup T* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = 0, bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const device T* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = 0, bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_store(simdgroup_matrix<T, Cols, Rows> a, threadgroup T* dst, ulong elements_per_row = Cols,
                     ulong2 matrix_origin = 0, bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_store(simdgroup_matrix<T, Cols, Rows> a, device T* dst, ulong elements_per_row = Cols,
                     ulong2 matrix_origin = 0, bool transpose_matrix = false);
template <class T, int C, int R, int K>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, C, R>& d, const thread simdgroup_matrix<T, K, R>& a,
                                   const thread simdgroup_matrix<T, C, K>& b,
                                   const thread simdgroup_matrix<T, C, R>& c);
template <class T, int C, int R, int K>
void simdgroup_multiply(thread simdgroup_matrix<T, C, R>& d, const thread simdgroup_matrix<T, K, R>& a,
                        const thread simdgroup_matrix<T, C, K>& b);

}  // namespace metal

using namespace metal;
