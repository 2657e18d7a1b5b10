// Syntax-check stub (NOT Apple's header): just the declarations maxsim.mm and
// torch's ATen/mps headers use, so that clang on Linux can parse maxsim.mm against
// the real torch headers (tests/test_metal_emu.py::test_mm_parses). Signatures
// follow Apple's SDK; nothing here is compiled into anything.
#pragma once
#import <Metal/Metal.h>
@interface MPSGraph : NSObject
@end
@interface MPSGraphExecutionDescriptor : NSObject
@end
@interface MPSGraphCompilationDescriptor : NSObject
@end
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);
