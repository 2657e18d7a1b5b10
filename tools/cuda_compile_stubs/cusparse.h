// Compile-check stand-in (CI has the CUDA compiler but not cuSPARSE); torch
// headers only need the handle type.
#pragma once
typedef struct cusparseContext* cusparseHandle_t;
