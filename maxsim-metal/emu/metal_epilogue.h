// Undoes metal_prologue.h.
#undef kernel
#undef device
#undef threadgroup
#undef constant
#undef thread
#undef MS_ATTR
