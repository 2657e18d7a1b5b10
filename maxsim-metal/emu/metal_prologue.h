// Maps the Metal-only vocabulary of a .metal file to the emulator before the
// file is included as C++ (pair with metal_epilogue.h):
//   * address spaces (device, threadgroup, constant, thread) and `kernel`
//     vanish (constant becomes const),
//   * MS_ATTR(attribute) becomes a default argument that fetches what a Metal
//     dispatch would bind: [[buffer(n)]] -> the host's binding n,
//     [[threadgroup(0)]] -> this threadgroup's memory, and the thread
//     position attributes -> the emulated thread's ids,
//   * MS_REGISTER_KERNEL(name) registers the entry point under its Metal name.
#include "metal_emu.h"

#define MS_EMULATOR 1

using namespace metal;  // what <metal_stdlib> users write; the .metal does it under __METAL_VERSION__

#define MS_ATTR(x) MS_ATTR_##x
#define MS_ATTR_buffer(n) = ::emu::BufferArg{n}
#define MS_ATTR_threadgroup(n) = ::emu::ThreadgroupArg{n}
#define MS_ATTR_thread_position_in_grid = ::emu::attr3(::emu::kThreadPositionInGrid)
#define MS_ATTR_threadgroup_position_in_grid = ::emu::attr3(::emu::kThreadgroupPositionInGrid)
#define MS_ATTR_thread_position_in_threadgroup = ::emu::attr3(::emu::kThreadPositionInThreadgroup)
#define MS_ATTR_threads_per_threadgroup = ::emu::attr3(::emu::kThreadsPerThreadgroup)
#define MS_ATTR_threadgroups_per_grid = ::emu::attr3(::emu::kThreadgroupsPerGrid)
#define MS_ATTR_thread_index_in_threadgroup = ::emu::attr(::emu::kThreadIndexInThreadgroup, 0)
#define MS_ATTR_simdgroup_index_in_threadgroup = ::emu::attr(::emu::kSimdgroupIndexInThreadgroup, 0)
#define MS_ATTR_thread_index_in_simdgroup = ::emu::attr(::emu::kThreadIndexInSimdgroup, 0)
#define MS_ATTR_threads_per_simdgroup = ::emu::attr(::emu::kThreadsPerSimdgroup, 0)
#define MS_ATTR_simdgroups_per_threadgroup = ::emu::attr(::emu::kSimdgroupsPerThreadgroup, 0)

#define MS_REGISTER_KERNEL(name) static ::emu::Registrar ms_emu_registrar_##name(#name, [] { name(); });

#define kernel
#define device
#define threadgroup
#define constant const
#define thread
