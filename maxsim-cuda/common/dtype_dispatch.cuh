// The one dtype dispatch of the CUDA sources: f(T{}) with the device token
// type of a tensor's scalar type. float32 is the fallback case, so callers
// check the dtype they accept before dispatching.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace maxsim {

template <typename F>
auto dispatch_token_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kHalf: return f(__half{});
    case at::kBFloat16: return f(__nv_bfloat16{});
    case at::kChar: return f(int8_t{});
    case at::kFloat8_e4m3fn: return f(__nv_fp8_e4m3{});
    default: return f(float{});
  }
}

// The same for the floating-point token types only (fp32 / fp16 / bf16).
template <typename F>
auto dispatch_float_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kHalf: return f(__half{});
    case at::kBFloat16: return f(__nv_bfloat16{});
    default: return f(float{});
  }
}

// Whether ptr is a multiple of `bytes` (vector loads, TMA sources).
inline bool aligned_to(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

template <typename T>
constexpr bool kIs16Bit = std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;

}  // namespace maxsim
