// Compile-check stand-in: torch headers only need the handle type.
#pragma once
typedef struct cublasContext* cublasHandle_t;
typedef int cublasStatus_t;
