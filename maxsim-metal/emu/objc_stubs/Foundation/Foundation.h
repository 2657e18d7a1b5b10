// Syntax-check stub (NOT Apple's header): just the declarations maxsim.mm and
// torch's ATen/mps headers use, so that clang on Linux can parse maxsim.mm against
// the real torch headers (tests/test_metal_emu.py::test_mm_parses). Signatures
// follow Apple's SDK; nothing here is compiled into anything.
#pragma once
#include <stddef.h>
#include <stdint.h>
typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef signed char BOOL;
#define YES ((BOOL)1)
#define nil ((id)0)
#define Nil ((Class)0)
#define NO ((BOOL)0)
#define __MAC_OS_X_VERSION_MAX_ALLOWED 150000
@protocol NSObject
- (oneway void)release;
- (instancetype)retain;
@end
@interface NSObject <NSObject>
+ (instancetype)alloc;
+ (instancetype)new;
- (instancetype)init;
- (instancetype)retain;
- (oneway void)release;
@end
@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)s;
@property(readonly) const char* UTF8String;
@end
@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end
@interface NSDictionary : NSObject
@end
typedef struct dispatch_queue_s* dispatch_queue_t;
@protocol OS_dispatch_data <NSObject>
@end
typedef NSObject<OS_dispatch_data>* dispatch_data_t;
typedef void (^dispatch_block_t)(void);
void dispatch_sync(dispatch_queue_t q, dispatch_block_t b);
#define DISPATCH_DATA_DESTRUCTOR_DEFAULT NULL
dispatch_data_t dispatch_data_create(const void* buffer, size_t size, dispatch_queue_t queue, dispatch_block_t destructor);
#define API_AVAILABLE(...)
