// Compile-check stand-in: torch headers only need the handle type.
#pragma once
typedef struct cusolverDnContext* cusolverDnHandle_t;
