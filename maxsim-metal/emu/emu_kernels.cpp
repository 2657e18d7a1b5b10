// The Metal shaders, compiled as C++17 against the emulator (metal_emu.h).
// Nothing here knows about torch: this translation unit only defines the
// Metal vocabulary and includes the .metal files unchanged.
#include "metal_prologue.h"

#include "../maxsim.metal"
#include "emu_selftest.metal"

#include "metal_epilogue.h"
