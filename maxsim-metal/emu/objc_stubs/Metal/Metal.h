// Syntax-check stub (NOT Apple's header): just the declarations maxsim.mm and
// torch's ATen/mps headers use, so that clang on Linux can parse maxsim.mm against
// the real torch headers (tests/test_metal_emu.py::test_mm_parses). Signatures
// follow Apple's SDK; nothing here is compiled into anything.
#pragma once
#import <Foundation/Foundation.h>
@protocol MTLResource <NSObject>
@end
@protocol MTLBuffer <MTLResource>
@end
@protocol MTLFunction <NSObject>
@end
@protocol MTLLibrary <NSObject>
- (id<MTLFunction>)newFunctionWithName:(NSString*)name;
@end
@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@end
typedef struct { NSUInteger width, height, depth; } MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger w, NSUInteger h, NSUInteger d) { MTLSize s = {w, h, d}; return s; }
typedef enum : NSInteger { MTLGPUFamilyApple7 = 1007 } MTLGPUFamily;
typedef enum : NSInteger { MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2 } MTLMathMode;
@interface MTLCompileOptions : NSObject
@property BOOL fastMathEnabled;
@property MTLMathMode mathMode;
@end
@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end
@protocol MTLCommandQueue <NSObject>
@end
@protocol MTLSharedEvent <NSObject>
@end
@protocol MTLCommandBuffer <NSObject>
@end
@protocol MTLDevice <NSObject>
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source options:(MTLCompileOptions*)options error:(NSError**)error;
- (id<MTLLibrary>)newLibraryWithData:(dispatch_data_t)data error:(NSError**)error;
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)function error:(NSError**)error;
- (BOOL)supportsFamily:(MTLGPUFamily)family;
@property(readonly) NSUInteger maxThreadgroupMemoryLength;
@end
