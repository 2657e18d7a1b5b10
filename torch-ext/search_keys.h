// (score, document id) <-> int64 search key, one definition for the CPU and
// CUDA search helpers (contract in torch-ext/maxsim/retrieval.py): keys order
// as "higher score, then lower id"; NaN ranks below every number; INT64_MIN
// is an empty slot (-inf, -1).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MAXSIM_HD __host__ __device__
#else
#define MAXSIM_HD
#endif

namespace maxsim {
namespace search_keys {

constexpr int64_t kLow = 0xFFFFFFFFll;
constexpr int32_t kNanOrder = INT32_MIN;

MAXSIM_HD inline float from_bits(int32_t b) {
  float v;
  memcpy(&v, &b, 4);
  return v;
}

// A score's rank as a signed int (a key's high 32 bits).
MAXSIM_HD inline int32_t order(float v) {
  v += 0.0f;  // -0 -> +0: equal scores get equal keys
  int32_t bits;
  memcpy(&bits, &v, 4);
  return v != v ? kNanOrder : bits >= 0 ? bits : (bits ^ 0x7FFFFFFF);
}

MAXSIM_HD inline int64_t encode(float v, int64_t id) { return (int64_t)order(v) * (kLow + 1) + (kLow - id); }

// An id < 0 is an empty slot.
MAXSIM_HD inline int64_t encode_id(float v, int64_t id) { return id < 0 ? INT64_MIN : encode(v, id); }

// A key's id; -1 for an empty slot.
MAXSIM_HD inline int64_t id_of(int64_t key) { return key == INT64_MIN ? -1 : kLow - (key & kLow); }

MAXSIM_HD inline void decode(int64_t key, float& score, int64_t& id) {
  id = id_of(key);
  if (key == INT64_MIN) {
    score = from_bits((int32_t)0xff800000);
    return;
  }
  const int32_t order = (int32_t)(key >> 32);
  score = order == kNanOrder ? from_bits(0x7fc00000) : from_bits(order >= 0 ? order : (order ^ 0x7FFFFFFF));
}

}  // namespace search_keys
}  // namespace maxsim
