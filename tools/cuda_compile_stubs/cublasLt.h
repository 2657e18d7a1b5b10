// Compile-check stand-in: torch headers only need the handle type.
#pragma once
typedef struct cublasLtContext* cublasLtHandle_t;
