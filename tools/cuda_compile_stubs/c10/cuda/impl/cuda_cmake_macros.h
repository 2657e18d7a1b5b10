// Compile-check stand-in: a CPU build of torch does not ship this generated header.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
