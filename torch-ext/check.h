// TORCH_CHECK with a printf-formatted message. Messages streamed with
// c10::str (std::ostringstream instantiated in this library) can segfault
// when thrown (seen with a torch 2.11 + g++ 13 build), while literal and
// snprintf-built ones raise: every formatted message of the CPU and CUDA
// backends goes through this macro.
#pragma once

#include <c10/util/Exception.h>

#include <cstdio>

#define MAXSIM_CHECK(cond, ...)                                                   \
  do {                                                                            \
    if (C10_UNLIKELY(!(cond))) {                                                  \
      char maxsim_check_msg_[256];                                                \
      std::snprintf(maxsim_check_msg_, sizeof maxsim_check_msg_, __VA_ARGS__);    \
      TORCH_CHECK(false, static_cast<const char*>(maxsim_check_msg_));            \
    }                                                                             \
  } while (0)
